"""tools/benchmark/dlm_rl.sh (and the dlm_recipes.sh stages it chains): the runs each stage makes, read with
stand-in `torchrun` and `python` that record their arguments (the real runs need a GPU)."""

from tests.unit_tests.test_trained_generation_script import run_stage

SCRIPT = "tools/benchmark/dlm_rl.sh"


def flag(call: list, name: str) -> str:
    return call[call.index(name) + 1]


def test_sft_adapts_the_dlm_then_fine_tunes_it_and_the_ar_twin_on_sudoku(tmp_path):
    code, calls = run_stage(tmp_path, "sft", script=SCRIPT)
    work = str(tmp_path / "work")
    assert code == 0
    conversions = [c for c in calls if c[0] == "tools/weights_conversion/hf_to_megatron.py"]
    assert [flag(c, "--model-running-mode") for c in conversions] == ["difflm-shift", "vanilla"]
    runs = [(flag(c, "--load"), flag(c, "--save"), flag(c, "--train-iters"), flag(c, "--seq-length"))
            for c in calls if c[0] == "--standalone"]
    assert runs == [(f"{work}/init_difflm-shift", f"{work}/recipe_mdlm.new", "400", "512"),
                    (f"{work}/recipe_mdlm", f"{work}/recipe_mdlm_sft_sudoku.new", "300", "192"),
                    (f"{work}/init_vanilla", f"{work}/recipe_ar_sft_sudoku.new", "300", "192")]
    fine_tuning = [c for c in calls if "--sft" in c]
    assert len(fine_tuning) == 2 and all(flag(c, "--train-data-path") == f"{work}/data/sudoku_train_text_document"
                                         for c in fine_tuning)


def test_rl_scores_the_policy_before_then_trains_it(tmp_path):
    code, calls = run_stage(tmp_path, "rl", script=SCRIPT, args=("dlm", "spg"), RL_ITERS="7")
    work = str(tmp_path / "work")
    assert code == 0 and len(calls) == 2 and all(c[3] == "posttrain_rl.py" for c in calls)
    before, training = calls
    assert "--skip-train" in before and "--skip-train" not in training
    for call in calls:
        assert flag(call, "--load") == f"{work}/recipe_mdlm_sft_sudoku" and flag(call, "--rl-algorithm") == "spg"
        assert flag(call, "--seq-length") == "256" and flag(call, "--global-batch-size") == "128"
        assert flag(call, "--train-iters") == "7" and flag(call, "--rl-block-length") == "32"
        assert "--rl-kl-beta" not in call and "--rl-reference" not in call  # SPG takes no KL term
        assert flag(call, "--rl-advantage") == "dr_grpo" and flag(call, "--rl-spg-beta") == "1.0"  # SPG's Sudoku
        assert flag(call, "--rl-temperature") == "0.3"  # recipe: centred rewards, beta 1, temperature 0.3
        assert flag(call, "--rl-log-completions") == "4"  # what the greedy policy writes, in the log
        assert flag(call, "--rl-clip-low") == "0.2" and flag(call, "--rl-clip-high") == "0.28"
        assert "--rl-cuda-graphs" in call and "--rl-sampling-steps" not in call
    results = tmp_path / "work" / "rl"
    assert (results / "dlm_spg.log").exists() and (results / "dlm_spg.before.log").exists()
    code, calls = run_stage(tmp_path, "rl", script=SCRIPT, args=("ar", "grpo"), KL_BETA="0", CUDA_GRAPHS="0",
                            SAMPLING_STEPS="16", RUN="ar_plain")
    assert code == 0 and flag(calls[-1], "--load") == f"{work}/recipe_ar_sft_sudoku"
    assert not {"--rl-block-length", "--rl-kl-beta", "--rl-reference", "--rl-cuda-graphs", "--rl-sampling-steps"} & set(
        calls[-1])
    assert (results / "ar_plain.log").exists() and (results / "ar_plain.before.log").exists()
    code, calls = run_stage(tmp_path, "rl", script=SCRIPT, args=("dlm", "diffu_grpo"), SAMPLING_STEPS="16",
                            INNER_STEPS="4", CLIP_LOW="0.5", CLIP_HIGH="0.5", RL_LR="3e-6")
    assert code == 0 and flag(calls[-1], "--rl-sampling-steps") == "16" and flag(calls[-1], "--rl-inner-steps") == "4"
    assert flag(calls[-1], "--rl-clip-low") == flag(calls[-1], "--rl-clip-high") == "0.5"  # d1's recipe
    assert flag(calls[-1], "--lr") == flag(calls[-1], "--min-lr") == "3e-6"
    assert flag(calls[-1], "--rl-kl-beta") == "0.04" and flag(calls[-1], "--rl-reference") == flag(calls[-1], "--load")
    assert "--rl-advantage" not in calls[-1]  # d1's: over the group's std, posttrain_rl.py's default
    assert flag(calls[-1], "--rl-temperature") == "1.0" and "--rl-spg-beta" not in calls[-1]
    code, _ = run_stage(tmp_path, "rl", script=SCRIPT, args=("policy", "grpo"))
    assert code == 2


def test_speed_runs_each_policy_eager_and_with_graphs(tmp_path):
    code, calls = run_stage(tmp_path, "speed", script=SCRIPT)
    work = str(tmp_path / "work")
    runs = [c for c in calls if "posttrain_rl.py" in c]
    assert len(runs) == 6 and all(flag(c, "--train-iters") == "6" and "--rl-kl-beta" not in c for c in runs)
    settings = [(flag(c, "--load").rsplit("/", 1)[1], c.count("--rl-cuda-graphs"),
                 flag(c, "--rl-sampling-steps") if "--rl-sampling-steps" in c else None) for c in runs]
    assert settings == [("recipe_mdlm_sft_sudoku", 0, "32"), ("recipe_mdlm_sft_sudoku", 1, "32"),
                        ("recipe_mdlm_sft_sudoku", 0, "16"), ("recipe_mdlm_sft_sudoku", 1, "16"),
                        ("recipe_ar_sft_sudoku", 0, None), ("recipe_ar_sft_sudoku", 1, None)]
    table = calls[-1]
    assert table[0] == "tools/benchmark/rl_table.py" and flag(table, "--results") == f"{work}/rl/speed"
    assert table[3:] == ["dlm_steps32_graphs0", "dlm_steps32_graphs1", "dlm_steps16_graphs0", "dlm_steps16_graphs1",
                         "ar_graphs0", "ar_graphs1"]


def test_prepare_rewards_training_by_partial_credit_and_holds_out_the_share_solved(tmp_path):
    code, calls = run_stage(tmp_path, "prepare", script=SCRIPT)
    work = str(tmp_path / "work")
    built = {flag(c, "--output"): c for c in calls if c[0] == "tools/build_rl_task.py"}
    assert code == 0 and "--reward" not in built[f"{work}/sudoku_train.jsonl.gz"]  # SFT records: no reward
    assert flag(built[f"{work}/sudoku_rl_train.jsonl.gz"], "--reward") == "sudoku_cells"
    assert flag(built[f"{work}/sudoku_rl_valid.jsonl.gz"], "--reward") == "sudoku"
    assert flag(built[f"{work}/sudoku_rl_valid.jsonl.gz"], "--count") == "256"
