"""Evaluation of our models by other people's harnesses.

`megatron.evaluation.scoring` is the batched answer scorer (torch only). Importing
`megatron.evaluation.lm_eval_adapter` registers the lm-evaluation-harness model ``megadlms``;
it is the only module here that imports lm-eval, so this package imports without it.
"""
