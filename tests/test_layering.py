"""Import layering (docs/DESIGN.md, Layering): dependencies run one way, down the stack. The
kernels (`kernels_pallas`) import nothing of the model or above it; the model (`v41_jax.model`)
imports nothing of the runtime, cache, tools, scripts or serving.

Every import statement (module level or inside a function, `import a.b` and `from a.b import c`,
relative ones resolved) of every module in a lower package is parsed with `ast`; none may name a
package above it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

ABOVE_MODEL = ("v41_jax.runtime", "v41_jax.cache", "v41_jax.tools", "scripts", "serving")
ABOVE_KERNELS = ("v41_jax.model",) + ABOVE_MODEL


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, dotted module) for every import in the file; `from a import b` yields a.b as well as a
    (b may be a submodule)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = _module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package[:len(package) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            out.append((node.lineno, base))
            out += [(node.lineno, f"{base}.{alias.name}") for alias in node.names if alias.name != "*"]
    return out


def _is_under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def violations(package: str, forbidden: tuple[str, ...]) -> list[str]:
    files = sorted((ROOT / package.replace(".", "/")).rglob("*.py"))
    assert files, f"no modules found under {package}"
    bad = {}  # one line per import statement: its first forbidden module
    for f in files:
        for line, mod in imported_modules(f):
            if any(_is_under(mod, p) for p in forbidden):
                bad.setdefault((f.relative_to(ROOT).as_posix(), line), mod)
    return [f"{f}:{line}: imports {mod}" for (f, line), mod in bad.items()]


@pytest.mark.parametrize("package, forbidden", [
    ("kernels_pallas", ABOVE_KERNELS),
    ("v41_jax.model", ABOVE_MODEL),
])
def test_lower_layers_do_not_import_upper_ones(package, forbidden):
    bad = violations(package, forbidden)
    assert not bad, f"{package} imports from layers above it:\n  " + "\n  ".join(bad)


def test_linear_takes_only_the_dense_kernel_and_that_kernel_not_linear():
    """`v41_jax.linear`, below the kernels, calls one of them (`kernels_pallas.dense_fp8`: the dense
    FP8 weights held as published); that module and the kernel helpers it imports never import
    `v41_jax.linear` back, so the routed-expert reference loop's `lin4` stays one way down."""
    from_kernels = {m for _, m in imported_modules(ROOT / "v41_jax/linear.py") if _is_under(m, "kernels_pallas")}
    assert from_kernels <= {"kernels_pallas.dense_fp8", "kernels_pallas.dense_fp8.dense_fp8",
                            "kernels_pallas.dense_fp8.takes"}, from_kernels
    below = {"dense_fp8", "backend", "_codecs", "_compat"}       # closed: each imports only these
    for name in below:
        mods = [m for _, m in imported_modules(ROOT / f"kernels_pallas/{name}.py")]
        assert not [m for m in mods if _is_under(m, "v41_jax.linear")], name
        assert {m.split(".")[1] for m in mods if m.startswith("kernels_pallas.")} <= below, name


def test_the_checker_sees_every_import_form(tmp_path, monkeypatch):
    """Late (in-function) imports, `from pkg import module` and relative imports all count."""
    pkg = tmp_path / "kernels_pallas"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from v41_jax.model import moe as ref\n")
    (pkg / "b.py").write_text("import v41_jax.model.numerics\n")
    (pkg / "c.py").write_text("from ..v41_jax.model.numerics import HIGHEST\n")
    (pkg / "d.py").write_text("from v41_jax import model, quant\n")
    (pkg / "ok.py").write_text("from v41_jax.quant import held\nfrom . import backend\n")
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    bad = violations("kernels_pallas", ABOVE_KERNELS)
    assert sorted({b.split(":")[0] for b in bad}) == [f"kernels_pallas/{n}.py" for n in "abcd"]
