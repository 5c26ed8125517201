"""A rank started by `--tp N` (runtime/tp.py): load() with rank 0's arguments, from CPUMLA_TP_LOAD. The
load joins the ranks and follows rank 0's commands; it never returns."""

from __future__ import annotations

import json
import os

from cpumla.errors import CpumlaError
from cpumla.runtime.loader import load
from cpumla.runtime.tp import LOAD_ENV


def main() -> None:
    try:
        load(**json.loads(os.environ[LOAD_ENV]))
    except CpumlaError:
        os._exit(1)        # every rank saw it at the agreement; rank 0 reports it
    except KeyboardInterrupt:
        os._exit(130)
    os._exit(0)


if __name__ == "__main__":
    main()
