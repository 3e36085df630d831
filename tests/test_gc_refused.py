"""`jupyter cedana gc` and what adoption refuses: a park record no server can adopt (it
does not parse, or its kernelspec is gone) is reported with the reason, and removed with
its image; a record a server can adopt keeps its image."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

from jupyter_cedana.checkpoint.store import CheckpointStore

JUPYTER = str(Path(sys.executable).parent / "jupyter")


def image(store: CheckpointStore, kid: str) -> Path:
    tmp = store.begin(kid)
    (tmp / "pages-1.img").write_bytes(b"p" * 4096)
    store.commit(kid, tmp, {"timings": {}})
    return store.path(kid)


def record(store: CheckpointStore, kid: str, kernel_name: str) -> Path:
    path = store.root / ".parked" / f"{kid}.json"
    path.parent.mkdir(mode=0o700, exist_ok=True)
    body = {
        "format": 1,
        "kernel_id": kid,
        "kernel_name": kernel_name,
        "connection_info": {"key": "k", "ip": "127.0.0.1"},
        "uid": os.geteuid(),
    }
    path.write_text(json.dumps(body))
    return path


def gc(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    # No running server (an empty runtime directory); kernelspecs as this user sees them.
    env = {**os.environ, "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime")}
    result = subprocess.run(
        [JUPYTER, "cedana", "gc", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result


def test_gc_reports_and_removes_what_adoption_refuses(tmp_path: Path) -> None:
    root = tmp_path / "root"
    store = CheckpointStore(root)
    store.ensure_root()
    good, torn, nospec = (str(uuid.uuid4()) for _ in range(3))
    for kid in (good, torn, nospec):
        image(store, kid)
    record(store, good, "python3")  # ipykernel's own kernelspec: always there
    record(store, torn, "python3").write_text("{not json")
    gone = f"removed-{uuid.uuid4().hex[:8]}"
    record(store, nospec, gone)

    dry = gc(tmp_path, "--root", str(root), "--dry-run")
    assert f"Would remove record of kernel {torn}" in dry.stdout, dry.stdout
    assert "does not parse" in dry.stdout
    assert f"Would remove image of kernel {nospec}" in dry.stdout
    assert f"its kernelspec '{gone}' is gone" in dry.stdout
    assert good not in dry.stdout
    assert all(store.exists(k) for k in (good, torn, nospec))

    report = json.loads(gc(tmp_path, "--root", str(root), "--yes", "--json").stdout)
    removed = {(r["kind"], r["kernel_id"]): r.get("why") for r in report["removed"]}
    assert set(removed) >= {
        ("record", torn),
        ("image", torn),
        ("record", nospec),
        ("image", nospec),
    }
    assert all(kid != good for _kind, kid in removed)
    assert "does not parse" in str(removed["image", torn])
    assert store.exists(good) and (root / ".parked" / f"{good}.json").is_file()
    assert not store.exists(torn) and not store.exists(nospec)
    assert sorted(p.name for p in (root / ".parked").iterdir()) == [f"{good}.json"]
