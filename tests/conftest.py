import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from cpumla import native  # noqa: E402

ALL_ISAS = native.ISAS      # every level cpumla knows, built here or not

# Subprocesses (python -m cpumla in a test's folder, the benchmark scripts) import the cpumla these tests
# do: the checkout's, when that is where it came from (not installed, or run with it first on the path).
_checkout = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(native.__file__)))) == _checkout:
    os.environ["PYTHONPATH"] = os.pathsep.join([_checkout] + [p for p in [os.environ.get("PYTHONPATH")] if p])


def pytest_report_header(config):
    native.init("")
    return [f"cpumla: cpu {native.cpu_name()}; built {' '.join(native.built_isas())}; "
            f"runnable here {' '.join(native.available_isas())}; threads {native.get_threads()}"]


@pytest.fixture(scope="session")
def v2_lite_dir(tmp_path_factory):
    """A tiny random DeepSeek-V2-Lite saved by transformers' save_pretrained, shared by the session: copy it
    before changing anything in it."""
    from support import models

    d = tmp_path_factory.mktemp("v2lite")
    models.build("v2-lite", d)
    return d


@pytest.fixture(params=ALL_ISAS)
def isa(request):
    """Every implementation: runs on those this CPU has, skips (saying why) the others."""
    name = request.param
    if name not in native.built_isas():
        pytest.skip(f"{name}: not built for this architecture")
    if name not in native.available_isas():
        pytest.skip(f"{name}: this CPU/OS cannot run it (tested wherever such a CPU is found)")
    native.init(name)
    yield name
    native.init("")


@pytest.fixture(params=["l1", "l2", "l2+l1"])
def gemv_prefetch(request):
    """Every target of the GEMVs' software prefetch (cpumla_set_gemv_prefetch): each is its own
    specialisation of the row loops, so each is checked; afterwards the CPU's own choice again."""
    native.set_gemv_prefetch(request.param)
    yield request.param
    native.set_gemv_prefetch("auto")
