"""Every loss and grad norm of the tiny parity configurations, in full precision, for proving a
restructuring changes nothing:

    python -m tests.distributed.dump_losses before.json     # on the old commit
    python -m tests.distributed.dump_losses after.json      # on the new one
    cmp before.json after.json

One process trains the layout matrix's configurations (DLM and AR), a masked-only-loss run and a
variable-length run with dropout; `repr` keeps every bit of each float.
"""

import json
import pathlib
import sys
import tempfile

from tests.distributed.parity import run_many
from tests.distributed.test_layout_matrix import ALL, argv_of

EXTRA = [argv_of("llama", "dlm") + ["--difflm-masked-only-loss", "--difflm-loss-chunk-size", "16"],
         argv_of("megatron", "dlm") + ["--difflm-varilen-prob", "0.5", "--hidden-dropout", "0.1"]]

if __name__ == "__main__":
    argvs = [argv_of(*pair) for pair in ALL] + EXTRA
    results = run_many(1, argvs, pathlib.Path(tempfile.mkdtemp()), "dump")
    out = {" ".join(argv): {"losses": [repr(x) for x in r["losses"]], "norms": [repr(x) for x in r["norms"]]}
           for argv, r in zip(argvs, results)}
    with open(sys.argv[1], "w") as handle:
        json.dump(out, handle, indent=1)
