"""tests/compile_census.py, the suite-time plugin: a pytest run with it names each executable
compiled under the test that compiled it, and its table reads the files back."""

import json
import subprocess
import sys

from tests.compile_census import summary
from tests.engine_common import ROOT

TEST = "tests/test_quant.py::test_e2m1_ties_to_even"


def test_census_attributes_compiles_to_their_test(tmp_path):
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "tests.compile_census",
                           "--compile-census", str(tmp_path), TEST], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    (census,) = tmp_path.glob("census-*.json")
    data = json.loads(census.read_text())
    assert data["writes"] and all(test == TEST for test, *_ in data["writes"])
    assert data["events"][TEST]["/jax/core/compile/backend_compile_duration#n"] >= len(data["writes"])
    table = summary(tmp_path)
    assert table.startswith(f"{len(data['writes'])} executables compiled") and TEST in table
