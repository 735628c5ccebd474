"""Every notebook runs top to bottom (nbclient, a real kernel) on its small configuration."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))
PUBLIC = Path(__file__).resolve().parents[2] / "shared" / "validation" / "public_runs.csv"


def test_the_four_notebooks_exist() -> None:
    assert [p.name[:2] for p in NOTEBOOKS] == ["01", "02", "03", "04"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_executes(path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if path.name.startswith("04") and not PUBLIC.is_file():
        pytest.skip("the public runs file is not beside the repository")
    # the notebooks write their traces and figures under tempfile.mkdtemp() for the reader to
    # open; the kernel inherits TMPDIR, so a test run leaves them in pytest's own directory
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    assert any("image/png" in o.get("data", {}) for o in outputs)  # it draws something
    if not path.name.startswith("04"):  # (the validation notebook writes nothing)
        assert any(tmp_path.glob("trainsim-nb*")), "the notebook's files went elsewhere"
