"""Which of a project's files `esk dev` watches, and that a change to one is seen."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from esk.code_watch import CodeWatch, project_sources
from esk.settings import Settings


def test_the_packages_and_modules_esk_imports_are_watched_not_the_whole_project(tmp_path: Path) -> None:
    (tmp_path / "shop").mkdir()
    (tmp_path / "shop" / "aggregates.py").write_text("")
    (tmp_path / "reports.py").write_text("")
    (tmp_path / ".venv").mkdir()
    settings = Settings(
        domain="shop.aggregates:AGGREGATES",
        read_models="reports:READ_MODELS",
        subscriptions="shop.subscribers:SUBSCRIPTIONS",  # the same package: watched once
        _env_file=None,
    )
    assert project_sources(settings, tmp_path) == [tmp_path / "shop", tmp_path / "reports.py"]
    # installed elsewhere, or not there at all: nothing of the project to watch
    elsewhere = Settings(domain="esk_examples.bank:AGGREGATES", read_models="nothing:X", subscriptions="none:X", _env_file=None)
    assert project_sources(elsewhere, tmp_path) == []


def test_the_project_modules_they_import_are_watched_too_not_installed_ones(tmp_path: Path) -> None:
    (tmp_path / "shop").mkdir()
    (tmp_path / "helpers.py").write_text("")
    (tmp_path / "common" / "money").mkdir(parents=True)
    installed = tmp_path / ".venv" / "lib" / "python3.11" / "site-packages" / "pydantic" / "main.py"
    installed.parent.mkdir(parents=True)
    settings = Settings(domain="shop:AGGREGATES", read_models="shop:READ_MODELS", subscriptions="shop:SUBSCRIPTIONS", _env_file=None)
    imported = [
        tmp_path / "shop" / "__init__.py",
        tmp_path / "helpers.py",
        tmp_path / "common" / "money" / "amounts.py",
        installed,
        Path("/usr/lib/python3.11/json/__init__.py"),
    ]
    assert project_sources(settings, tmp_path, imported) == [tmp_path / "shop", tmp_path / "helpers.py", tmp_path / "common"]
    # run from `/` (or a folder that holds a Python): Python's own library is not the project's
    assert project_sources(settings, Path("/"), [Path(json.__file__), Path(pytest.__file__)]) == []


def _changes(watch: CodeWatch) -> set[Path]:
    deadline = time.monotonic() + 10
    changed: set[Path] = set()
    while not changed and time.monotonic() < deadline:
        time.sleep(0.1)
        changed = watch.changed()
    return changed


def test_a_changed_python_file_is_told_once_and_other_files_are_not(tmp_path: Path) -> None:
    package = tmp_path / "shop"
    package.mkdir()
    module = package / "aggregates.py"
    module.write_text("A = 1\n")
    watch = CodeWatch([package]).start()
    try:
        time.sleep(0.5)  # the watch is set up in its thread
        (package / "notes.txt").write_text("not code")
        module.write_text("A = 2\n")
        assert _changes(watch) == {module}
        assert watch.changed() == set()  # handed over once
    finally:
        watch.stop()


def test_a_module_saved_by_renaming_a_new_file_over_it_is_told_each_time(tmp_path: Path) -> None:
    """As many editors save: a watch on the file itself would end at the first such save."""
    module, other = tmp_path / "reports.py", tmp_path / "notes.py"
    module.write_text("A = 1\n")
    watch = CodeWatch([module]).start()
    try:
        time.sleep(0.5)
        for n in (2, 3):
            saved = tmp_path / f".reports.py.{n}"
            saved.write_text(f"A = {n}\n")
            saved.replace(module)
            assert module in _changes(watch), n
        other.write_text("not watched\n")  # beside it, not one of the project's sources
        module.write_text("A = 4\n")
        assert _changes(watch) == {module}
    finally:
        watch.stop()


def test_a_save_that_changes_nothing_is_no_change_and_a_removed_file_is_one(tmp_path: Path) -> None:
    package = tmp_path / "shop"
    package.mkdir()
    module, other = package / "aggregates.py", package / "orders.py"
    module.write_text("A = 1\n")
    other.write_text("B = 1\n")
    watch = CodeWatch([package]).start()
    try:
        time.sleep(0.5)
        module.write_text("A = 1\n")  # an editor's save without an edit
        module.touch()
        other.unlink()
        assert _changes(watch) == {other}
        module.write_text("A = 2\n")
        assert _changes(watch) == {module}
    finally:
        watch.stop()


def test_esk_dev_without_spark_says_once_that_the_read_models_are_not_kept_up(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import importlib.util

    from esk.cli import dev_read_models
    from esk.runtime import DEV_CHILD_VARIABLE

    found = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: None if name == "pyspark" else found(name, *args))
    settings = Settings(read_models="projections.read_models:READ_MODELS", _env_file=None)
    assert dev_read_models(settings) == []
    assert capsys.readouterr().out == "read models are not kept up: they need the spark extra (pip install 'esk[spark]')\n"
    # the processes' parent, started anew at each change to the code: esk dev said it already
    monkeypatch.setenv(DEV_CHILD_VARIABLE, "1")
    assert dev_read_models(settings) == []
    assert capsys.readouterr().out == ""
