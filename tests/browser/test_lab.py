"""JupyterLab in chromium: the sidebar suspends a kernel, the next cell restores it.

Each test opens its own notebook (so its own kernel) in a fresh browser context.
Screenshots go to test-artifacts/.
"""

from __future__ import annotations

import json
import os
import re
import socket
import time
from pathlib import Path
from typing import Any

import pytest

from .conftest import ARTIFACTS, LabServer

pytestmark = [pytest.mark.browser, pytest.mark.criu]

PANEL_ID = "jupyter-cedana-panel"
SUSPEND_TIMEOUT_MS = 120_000


def _write_notebook(server: LabServer, name: str, cells: list[str]) -> str:
    nb = {
        "cells": [
            {
                "cell_type": "code",
                "execution_count": None,
                "id": f"cell-{i}",
                "metadata": {},
                "outputs": [],
                "source": src,
            }
            for i, src in enumerate(cells)
        ],
        "metadata": {
            "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
            "language_info": {"name": "python"},
        },
        "nbformat": 4,
        "nbformat_minor": 5,
    }
    (server.root_dir / name).write_text(json.dumps(nb))
    return name


def _open_notebook(page: Any, server: LabServer, name: str) -> str:
    """Open a notebook, wait for its kernel to be idle; returns the kernel id."""
    # `reset` starts from an empty workspace: only this notebook is open.
    page.goto(server.lab_url(f"lab/tree/{name}") + "&reset")
    _notebook(page).wait_for(state="visible", timeout=60_000)
    kernel_id = server.kernel_of(name)
    _wait_execution_state(server, kernel_id, "idle")
    _cells(page).first.wait_for(state="visible")
    return kernel_id


def _notebook(page: Any) -> Any:
    """The notebook panel shown now."""
    return page.locator(".jp-NotebookPanel >> visible=true").first


def _cells(page: Any) -> Any:
    return _notebook(page).locator(".jp-Notebook .jp-Cell")


def _wait_execution_state(
    server: LabServer, kernel_id: str, state: str, timeout: float = 60
) -> None:
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        status, body = server.request("GET", f"api/kernels/{kernel_id}")
        last = body
        if status == 200 and body.get("execution_state") == state:
            return
        time.sleep(0.25)
    raise AssertionError(f"kernel {kernel_id} not {state}: {last}")


def _run_cell(page: Any, index: int) -> None:
    cell = _cells(page).nth(index)
    cell.locator(".jp-InputArea-editor").click()
    page.keyboard.press("Shift+Enter")


def _cell_output(page: Any, index: int) -> Any:
    return _cells(page).nth(index).locator(".jp-OutputArea-output")


def _open_panel(page: Any) -> Any:
    tab = page.locator(f'li[data-id="{PANEL_ID}"]')
    tab.wait_for(state="visible")
    panel = page.locator(f"#{PANEL_ID}")
    if not panel.is_visible():
        tab.click()
    panel.wait_for(state="visible")
    return panel


def _card(page: Any, kernel_id: str) -> Any:
    card = page.locator(f'#{PANEL_ID} .jp-cedana-kernel[data-kernel-id="{kernel_id}"]')
    card.wait_for(state="visible", timeout=30_000)
    return card


def _kernel(server: LabServer, kernel_id: str) -> dict[str, Any]:
    return server.get(f"api/cedana/kernels/{kernel_id}")


def _kernel_pids(kernel_id: str) -> list[int]:
    """Processes whose command line names the kernel's connection file."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if f"kernel-{kernel_id}" in cmdline and "ipykernel" in cmdline:
            pids.append(int(entry.name))
    return pids


def _wait_suspend_enabled(page: Any, kernel_id: str) -> None:
    # The panel polls; the button is enabled once the kernel is known as running.
    page.wait_for_function(
        """id => {
            const b = document.querySelector(
              `.jp-cedana-kernel[data-kernel-id="${id}"] button.jp-cedana-suspend`);
            return b && !b.disabled;
        }""",
        arg=kernel_id,
        timeout=30_000,
    )


def _suspend_from_sidebar(page: Any, server: LabServer, kernel_id: str) -> dict[str, Any]:
    card = _card(page, kernel_id)
    button = card.locator("button.jp-cedana-suspend")
    _wait_suspend_enabled(page, kernel_id)
    button.click()
    card.locator('.jp-cedana-badge[data-state="suspended"]').wait_for(timeout=SUSPEND_TIMEOUT_MS)
    return _kernel(server, kernel_id)


def test_suspend_from_sidebar_and_resume_on_next_cell(page: Any, lab_server: LabServer) -> None:
    name = _write_notebook(lab_server, "state.ipynb", ["x = 41", "x + 1"])
    kernel_id = _open_notebook(page, lab_server, name)

    _run_cell(page, 0)
    _cells(page).nth(0).locator(".jp-InputPrompt", has_text="[1]").wait_for(timeout=60_000)
    _wait_execution_state(lab_server, kernel_id, "idle")
    pids_before = _kernel_pids(kernel_id)

    panel = _open_panel(page)
    card = _card(page, kernel_id)
    # The card names the notebook and its kernelspec.
    assert "state.ipynb" in card.locator(".jp-cedana-kernel-name").inner_text()
    assert card.locator(".jp-cedana-kernelspec").inner_text() == "python3"
    assert card.locator("button.jp-cedana-resume").is_disabled()

    kernel = _suspend_from_sidebar(page, lab_server, kernel_id)

    # Server side: suspended, with an image on disk, and no kernel process left.
    assert kernel["state"] == "suspended", kernel
    assert kernel["checkpoint_bytes"] > 0, kernel
    if pids_before:
        assert _kernel_pids(kernel_id) == [], "the kernel process is still running"
    # The badge, the buttons and the summary say so.
    badge = card.locator(".jp-cedana-badge")
    assert badge.inner_text().lower().startswith("suspended")
    assert card.locator("button.jp-cedana-suspend").is_disabled()
    assert card.locator("button.jp-cedana-resume").is_enabled()
    assert card.locator(".jp-cedana-checkpoint").inner_text() != "\N{EN DASH}"
    assert re.match(r"1 / \d+", panel.locator(".jp-cedana-suspended-count").inner_text())
    # The notebook says its kernel is suspended, and so does the status bar.
    indicator = _notebook(page).locator(".jp-NotebookPanel-toolbar .jp-cedana-indicator")
    indicator.wait_for(state="visible")
    assert indicator.inner_text().strip() == "Suspended"
    status_item = page.locator(".jp-cedana-status-item")
    assert "1 kernel suspended" in status_item.inner_text()

    ARTIFACTS.mkdir(exist_ok=True)
    panel.screenshot(path=str(ARTIFACTS / "panel-suspended.png"))
    page.screenshot(path=str(ARTIFACTS / "notebook-suspended.png"))

    # Run a cell that uses the earlier state: no other step.
    _run_cell(page, 1)
    _cell_output(page, 1).filter(has_text="42").wait_for(timeout=SUSPEND_TIMEOUT_MS)
    assert _cell_output(page, 1).inner_text().strip() == "42"

    kernel = _kernel(lab_server, kernel_id)
    assert kernel["state"] == "running", kernel
    card.locator('.jp-cedana-badge[data-state="running"]').wait_for(timeout=30_000)
    _notebook(page).locator(
        '.jp-NotebookPanel-toolbar .jp-cedana-indicator[data-state="running"]'
    ).wait_for(state="attached", timeout=30_000)
    assert "resume" in card.locator(".jp-cedana-durations").inner_text()
    panel.screenshot(path=str(ARTIFACTS / "panel-resumed.png"))


def test_keep_awake_postpones_the_countdown(page: Any, lab_server: LabServer) -> None:
    name = _write_notebook(lab_server, "awake.ipynb", ["y = 1"])
    kernel_id = _open_notebook(page, lab_server, name)
    _open_panel(page)
    card = _card(page, kernel_id)
    # The default policy plans a suspend for an idle kernel: the countdown is there then.
    _wait_execution_state(lab_server, kernel_id, "idle")
    countdown = card.locator(".jp-cedana-countdown[data-seconds]")
    countdown.wait_for(timeout=30_000)
    before = _kernel(lab_server, kernel_id)
    assert before["suspend_at"] is not None, before
    seconds_before = countdown.get_attribute("data-seconds")

    card.locator("select.jp-cedana-keep-awake-select").select_option(str(4 * 3600))
    card.locator("button.jp-cedana-keep-awake-button").click()
    card.locator(".jp-cedana-keep-awake").wait_for(timeout=30_000)
    assert "kept awake" in countdown.inner_text()

    after = _kernel(lab_server, kernel_id)
    assert after["keep_awake_until"], after
    # The automatic suspend moved back by about the keep-awake time.
    assert after["suspend_at"] is not None
    assert after["suspend_at"] > before["suspend_at"]
    page.wait_for_function(
        """([id, before]) => {
            const el = document.querySelector(
              `.jp-cedana-kernel[data-kernel-id="${id}"] .jp-cedana-countdown`);
            return el && Number(el.dataset.seconds) > Number(before) + 3 * 3600;
        }""",
        arg=[kernel_id, seconds_before],
        timeout=15_000,
    )
    card.screenshot(path=str(ARTIFACTS / "panel-keep-awake.png"))


def test_failed_resume_shows_the_reason(page: Any, lab_server: LabServer) -> None:
    name = _write_notebook(lab_server, "corrupt.ipynb", ["z = 'kept'"])
    kernel_id = _open_notebook(page, lab_server, name)
    _run_cell(page, 0)
    _wait_execution_state(lab_server, kernel_id, "idle")
    _open_panel(page)
    kernel = _suspend_from_sidebar(page, lab_server, kernel_id)
    assert kernel["state"] == "suspended", kernel

    # Corrupt every image file of this kernel's checkpoint (not the manifest).
    corrupted = []
    for path in sorted(lab_server.checkpoint_root.rglob("*")):
        if not path.is_file() or kernel_id not in str(path.relative_to(lab_server.checkpoint_root)):
            continue
        if path.suffix == ".json" or path.stat().st_size == 0:
            continue
        with path.open("r+b") as f:
            size = path.stat().st_size
            f.seek(size // 2)
            f.write(os.urandom(min(4096, max(1, size - size // 2))))
        corrupted.append(path)
    if not corrupted:
        # The image directory is not named after the kernel: corrupt all images.
        for path in sorted(lab_server.checkpoint_root.rglob("*.img")):
            with path.open("r+b") as f:
                f.write(os.urandom(min(4096, path.stat().st_size or 1)))
            corrupted.append(path)
    assert corrupted, f"no image files under {lab_server.checkpoint_root}"

    card = _card(page, kernel_id)
    with page.expect_response(
        lambda r: f"/api/cedana/kernels/{kernel_id}/resume" in r.url, timeout=SUSPEND_TIMEOUT_MS
    ) as info:
        card.locator("button.jp-cedana-resume").click()
    response = info.value
    assert response.status >= 400, f"the resume of a corrupt image succeeded: {response.status}"
    message = response.json()["message"]
    assert message

    toast = page.locator(".Toastify__toast", has_text="Resume failed")
    toast.first.wait_for(timeout=30_000)
    text = toast.first.inner_text()
    # Let the toast finish sliding in before the screenshot.
    page.wait_for_function(
        """() => [...document.querySelectorAll('.Toastify__toast')].some(
            t => t.getBoundingClientRect().right <= window.innerWidth)""",
        timeout=10_000,
    )
    page.screenshot(path=str(ARTIFACTS / "resume-failed.png"))
    assert message[:60] in text, f"{message!r} not in the notification {text!r}"

    # The kernel is failed with the reason, its checkpoint kept.
    kernel = _kernel(lab_server, kernel_id)
    assert kernel["state"] == "failed", kernel
    assert kernel["reason"] and kernel["reason"][:60] in message, kernel
    assert any(p.exists() for p in corrupted)


def test_reload_leaves_a_suspended_kernel_suspended(page: Any, lab_server: LabServer) -> None:
    """Reloading the page reconnects to the kernel (kernel_info, debugger probes): the
    kernel stays suspended and JupyterLab shows it connected and idle. The next cell
    resumes it, with its state."""
    name = _write_notebook(lab_server, "reload.ipynb", ["w = 'kept'", "print(w * 2)"])
    kernel_id = _open_notebook(page, lab_server, name)
    _run_cell(page, 0)
    _cells(page).nth(0).locator(".jp-InputPrompt", has_text="[1]").wait_for(timeout=60_000)
    _wait_execution_state(lab_server, kernel_id, "idle")
    status, kernel = lab_server.request("POST", f"api/cedana/kernels/{kernel_id}/suspend")
    assert status == 200 and kernel["state"] == "suspended", kernel

    with page.expect_websocket(
        lambda ws: f"/api/kernels/{kernel_id}/channels" in ws.url, timeout=60_000
    ):
        page.reload()
    _notebook(page).wait_for(state="visible", timeout=60_000)
    # JupyterLab got its kernel_info answer: the kernel shows connected and idle.
    _notebook(page).locator('.jp-Notebook-ExecutionIndicator[data-status="idle"]').wait_for(
        timeout=60_000
    )
    indicator = _notebook(page).locator(".jp-NotebookPanel-toolbar .jp-cedana-indicator")
    indicator.wait_for(state="visible")
    assert indicator.inner_text().strip() == "Suspended"
    kernel = _kernel(lab_server, kernel_id)
    assert kernel["state"] == "suspended", kernel
    assert kernel["last_resume_seconds"] is None, kernel

    _run_cell(page, 1)
    _cell_output(page, 1).filter(has_text="keptkept").wait_for(timeout=SUSPEND_TIMEOUT_MS)
    kernel = _kernel(lab_server, kernel_id)
    assert kernel["state"] == "running" and kernel["last_resume_seconds"] is not None, kernel


def test_a_kernel_that_cannot_be_checkpointed_says_why(
    page: Any, lab_server: LabServer, tmp_path: Path
) -> None:
    """A kernel holding a socket to another process: the sidebar says why it is not
    suspended, and its Suspend button still tries."""
    path = tmp_path / "service.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(1)
    connect = f"import socket; s = socket.socket(socket.AF_UNIX); s.connect({str(path)!r})"
    try:
        name = _write_notebook(lab_server, "service.ipynb", [connect])
        kernel_id = _open_notebook(page, lab_server, name)
        _run_cell(page, 0)
        _cells(page).nth(0).locator(".jp-InputPrompt", has_text="[1]").wait_for(timeout=60_000)
        _wait_execution_state(lab_server, kernel_id, "idle")
        peer, _ = listener.accept()
        _open_panel(page)
        card = _card(page, kernel_id)
        button = card.locator("button.jp-cedana-suspend")
        _wait_suspend_enabled(page, kernel_id)
        button.click()
        note = card.locator(".jp-cedana-backoff.jp-cedana-not-checkpointable")
        note.wait_for(timeout=SUSPEND_TIMEOUT_MS)
        text = note.inner_text()
        assert text.startswith("Not checkpointable"), text
        assert "socket connected to a process outside the kernel" in text
        assert card.locator(".jp-cedana-badge").get_attribute("data-state") == "running"
        _wait_suspend_enabled(page, kernel_id)
        assert "Suspend tries anyway" in (button.get_attribute("title") or "")
        card.screenshot(path=str(ARTIFACTS / "panel-not-checkpointable.png"))
        assert _kernel(lab_server, kernel_id)["backoff"]["not_checkpointable"] is True
        peer.close()
    finally:
        listener.close()


SCREENSHOT_DIR_ENV = "CEDANA_SCREENSHOT_DIR"


def _widen_left_sidebar(page: Any, panel: Any, width: int) -> None:
    """Drag the handle between the left sidebar and the notebooks until the sidebar is
    about `width` pixels wide (its default leaves the card's lines wrapped)."""
    box = panel.bounding_box()
    handle = page.locator("#jp-main-split-panel > .lm-SplitPanel-handle:not(.lm-mod-hidden)")
    grip = handle.first.bounding_box()
    y = grip["y"] + grip["height"] / 2
    page.mouse.move(grip["x"] + grip["width"] / 2, y)
    page.mouse.down()
    page.mouse.move(box["x"] + width, y, steps=5)
    page.mouse.up()
    page.wait_for_function(
        "([id, width]) => document.getElementById(id).getBoundingClientRect().width >= width - 40",
        arg=[PANEL_ID, width],
        timeout=10_000,
    )


def test_sidebar_screenshot_of_a_suspended_kernel(page: Any, lab_server: LabServer) -> None:
    """The README's picture: a notebook whose cells ran, its kernel suspended from the
    sidebar, and the sidebar's card for it. Saved as test-artifacts/sidebar.png, and into
    $CEDANA_SCREENSHOT_DIR when set (scripts/screenshot.sh: docs/images/)."""
    page.set_viewport_size({"width": 1280, "height": 800})
    cells = [
        "import numpy as np\n"
        "rng = np.random.default_rng(seed=7)\n"
        "samples = rng.normal(loc=3.0, scale=0.5, size=(4_000, 2_000))\n"
        "samples.shape",
        "means = samples.mean(axis=1)\n"
        'print(f"mean of the means: {means.mean():.3f} ± {means.std():.4f}")',
    ]
    name = _write_notebook(lab_server, "analysis.ipynb", cells)
    kernel_id = _open_notebook(page, lab_server, name)
    for i in range(len(cells)):
        _run_cell(page, i)
        _cells(page).nth(i).locator(".jp-InputPrompt", has_text=f"[{i + 1}]").wait_for(
            timeout=60_000
        )
    assert _cell_output(page, 0).inner_text().strip() == "(4000, 2000)"
    assert "mean of the means: 3.000" in _cell_output(page, 1).inner_text()
    _wait_execution_state(lab_server, kernel_id, "idle")

    panel = _open_panel(page)
    _widen_left_sidebar(page, panel, 360)
    kernel = _suspend_from_sidebar(page, lab_server, kernel_id)
    assert kernel["state"] == "suspended", kernel
    card = _card(page, kernel_id)
    # What the picture is for: the state, the idle time, the image's size, the suspend's
    # duration, and the notebook's own indicator.
    assert card.locator(".jp-cedana-badge").inner_text().lower().startswith("suspended")
    assert re.search(r"\d", card.locator(".jp-cedana-idle").inner_text())
    assert re.search(r"\d+(\.\d+)? [KMG]B", card.locator(".jp-cedana-checkpoint").inner_text())
    assert "suspend" in card.locator(".jp-cedana-durations").inner_text()
    _notebook(page).locator(
        '.jp-NotebookPanel-toolbar .jp-cedana-indicator[data-state="suspended"]'
    ).wait_for(timeout=30_000)
    assert panel.locator(".jp-cedana-suspended-count").inner_text().startswith("1 / ")

    # No hover highlight on the button just clicked.
    page.mouse.move(1270, 790)
    ARTIFACTS.mkdir(exist_ok=True)
    targets = [ARTIFACTS / "sidebar.png"]
    if os.environ.get(SCREENSHOT_DIR_ENV):
        targets.append(Path(os.environ[SCREENSHOT_DIR_ENV]) / "sidebar.png")
    shot = page.screenshot()
    for target in targets:
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(shot)
