"""Every third-party import of the code is a declared dependency (issue 27).

Each ``.py`` file of ``cje_engine/`` and ``flows/`` is parsed with `ast`; the top-level module of every
``import``/``from ... import`` in it (at module level or inside a function: a lazy import is still needed
at run time) is mapped to the distributions that provide it (`importlib.metadata.packages_distributions`,
e.g. ``yaml`` -> ``PyYAML``, ``sklearn`` -> ``scikit-learn``), and one of them must be named in
``pyproject.toml``'s ``[project] dependencies``. Files under ``tests/`` may also use the ``test`` extra
(``pytest.importorskip("name")`` counts as an import there). Standard-library and first-party modules
are skipped; a module no installed distribution provides fails too (it could not be installed from
the declarations).
"""
from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIRST_PARTY = {"cje_engine", "flows", "tests"}


def _canonical(name: str) -> str:
    """PEP 503 normal form of a distribution name (``PyYAML`` -> ``pyyaml``, ``ray[default]`` -> ``ray``)."""
    bare = re.split(r"[\[<>=!~;\s]", name.strip(), maxsplit=1)[0]
    return re.sub(r"[-_.]+", "-", bare).lower()


def _declared() -> tuple[set[str], set[str]]:
    """Canonical names of ``[project] dependencies`` and of the ``test`` extra."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    runtime = {_canonical(d) for d in project["dependencies"]}
    test = {_canonical(d) for d in project.get("optional-dependencies", {}).get("test", [])}
    return runtime, test


def _imported_modules(path: Path) -> dict[str, int]:
    """Top-level module names imported by one file -> first line importing it (absolute imports only)."""
    found: dict[str, int] = {}
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr == "importorskip" and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            names = [node.args[0].value]
        for name in names:
            found.setdefault(name.split(".")[0], node.lineno)
    return found


def _local_modules(folder: Path) -> set[str]:
    """Module names importable from a test folder itself (``conftest`` helpers beside the tests)."""
    return {p.stem for p in folder.glob("*.py")} | {p.name for p in folder.iterdir() if (p / "__init__.py").exists()}


def undeclared_imports(folders: list[str], allowed: set[str], local_helpers: bool = False) -> list[str]:
    """``file:line: import X (distributions ...)`` for every third-party import of ``folders`` whose
    distributions are not among ``allowed`` (canonical names).

    Parameters
    ----------
    folders : list of str
        Folders under the repository root whose ``.py`` files are scanned.
    allowed : set of str
        Canonical distribution names that count as declared.
    local_helpers : bool
        Skip modules that are files beside the importing file (test helpers imported by bare name).

    Returns
    -------
    list of str
        One line per offending import, naming the file, the line, the module and its distributions.
    """
    providers = importlib.metadata.packages_distributions()
    problems = []
    for folder in folders:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if ".venv" in path.parts:
                continue
            local = _local_modules(path.parent) if local_helpers else set()
            for module, line in sorted(_imported_modules(path).items()):
                if module in sys.stdlib_module_names or module in FIRST_PARTY or module in local:
                    continue
                dists = providers.get(module, [])
                if not any(_canonical(d) in allowed for d in dists):
                    where = path.relative_to(ROOT)
                    what = ", ".join(sorted(set(dists))) or "no installed distribution provides it"
                    problems.append(f"{where}:{line}: import {module} ({what})")
    return problems


def test_the_code_imports_only_declared_dependencies():
    runtime, _ = _declared()
    problems = undeclared_imports(["cje_engine", "flows"], runtime)
    assert not problems, ("third-party imports not declared in pyproject.toml [project] dependencies:\n"
                          + "\n".join(problems))


def test_the_tests_import_only_declared_or_test_extra_dependencies():
    runtime, test = _declared()
    problems = undeclared_imports(["tests"], runtime | test, local_helpers=True)
    assert not problems, ("third-party imports of tests/ declared neither in [project] dependencies nor in "
                          "the test extra:\n" + "\n".join(problems))


def _release(version: str) -> tuple[int, ...]:
    """Numeric release of a version (``2.14.4`` -> ``(2, 14, 4)``; a pre/post suffix is ignored)."""
    return tuple(int(re.match(r"\d*", part).group() or 0) for part in version.split("."))


def admits(spec: str, version: str) -> bool:
    """Whether a requirement's version clauses (``>=``, ``<``, ``==``, ``<=``, ``>``, ``!=``) admit ``version``.

    Parameters
    ----------
    spec : str
        A requirement as written in pyproject.toml, e.g. ``"ray[default]>=2.40,<2.61"``.
    version : str
        A released version, e.g. ``"2.54.0"``.

    Returns
    -------
    bool
        True when every clause holds (a requirement without clauses admits every version).
    """
    clauses = re.findall(r"(>=|<=|==|!=|<|>)\s*([\w.*]+)", spec)
    have = _release(version)
    checks = {">=": lambda b: have >= b, "<=": lambda b: have <= b, ">": lambda b: have > b,
              "<": lambda b: have < b, "==": lambda b: have == b, "!=": lambda b: have != b}
    width = max([len(have)] + [len(_release(v)) for _, v in clauses])
    have = have + (0,) * (width - len(have))
    return all(checks[op](_release(v) + (0,) * (width - len(_release(v)))) for op, v in clauses)


def test_declared_versions_admit_the_locked_ones():
    """Each declared range admits the version pinned in requirements.lock (what CI installs)."""
    locked = {}
    for line in (ROOT / "requirements.lock").read_text().splitlines():
        if "==" in line and not line.lstrip().startswith("#"):
            name, version = line.split("==", 1)
            locked[_canonical(name)] = version.split(";")[0].strip()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = list(project["dependencies"]) + list(project.get("optional-dependencies", {}).get("test", []))
    wrong = []
    for spec in declared:
        version = locked.get(_canonical(spec))
        if version is None:
            wrong.append(f"{spec}: not pinned in requirements.lock")
        elif not admits(spec, version):
            wrong.append(f"{spec}: requirements.lock pins {version}")
    assert not wrong, "pyproject.toml and requirements.lock disagree:\n" + "\n".join(wrong)


def test_the_version_check_reads_ranges_and_pins():
    assert admits("numpy>=2.0,<3", "2.4.1") and not admits("numpy>=2.0,<3", "3.0")
    assert admits("ray[default]>=2.40,<2.61", "2.54.0") and not admits("ray[default]>=2.40,<2.61", "2.61.0")
    assert admits("hypothesis==6.170.17", "6.170.17") and not admits("hypothesis==6.170.17", "6.170.18")


def test_the_check_names_an_undeclared_import(tmp_path, monkeypatch):
    """The scan itself: a file importing a module of an undeclared distribution is named with its line."""
    pkg = tmp_path / "fake_pkg"
    pkg.mkdir()
    (pkg / "mod.py").write_text("import os\nimport json\n\ndef f():\n    import yaml\n    return yaml\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    problems = undeclared_imports(["fake_pkg"], {"numpy"})
    assert problems == ["fake_pkg/mod.py:5: import yaml (PyYAML)"]
    assert undeclared_imports(["fake_pkg"], {"pyyaml"}) == []
