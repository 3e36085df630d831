"""A lazy restore at the agent that cannot bring all the memory back (a damaged chunk of
the image): the agent stops the kernel and keeps the image; the server says the resume
failed and what is lost, and the next cell resumes the kernel from that image. Real
agent (root), a real server as cedana-test, real ipykernel and CRIU; the damage is a
byte flipped in the agent's image, as a disk would."""

from __future__ import annotations

import pwd
from collections.abc import Callable

import pytest

from tests.test_lazy import EXPECTED_SUM, FILL, flip_byte, lazy_page_in

from .conftest import Agent
from .servers_on_agent import USER, UserServer, at_agent, eventually, kernel_tasks, still_alive

pytestmark = [pytest.mark.criu, pytest.mark.root]


def test_a_damaged_chunk_fails_the_resume_keeps_the_image_and_the_next_cell_resumes(
    live_agent: Agent, user_servers: Callable[..., UserServer]
) -> None:
    server = user_servers(USER)
    kid = server.start_kernel()
    address = int(server.output(kid, "x = 41\n" + FILL).strip())
    _, tasks = kernel_tasks(live_agent, USER, kid)
    server.suspend(kid)
    assert eventually(lambda: not still_alive(tasks)), still_alive(tasks)

    uid = pwd.getpwnam(USER).pw_uid
    image = live_agent.state_dir / "images" / str(uid) / kid
    name, offset = lazy_page_in(image, address + (16 << 20), address + (32 << 20))
    flip_byte(image / name, offset)

    # The cell resumes the kernel; the damaged chunk is met on demand or by the
    # background transfer, whichever comes first, and the kernel is stopped.
    reply = server.run(kid, "print(x)")
    assert reply.status in ("ok", "error"), reply
    assert eventually(lambda: server.kernel(kid)["state"] == "failed", 90), server.kernel(kid)
    reason = server.kernel(kid)["reason"]
    assert reason.startswith("The kernel failed while its memory was being restored"), reason
    assert "checksum" in reason and "is kept" in reason, reason
    assert at_agent(live_agent, USER, kid)["state"] == "dumped"
    assert image.is_dir()

    flip_byte(image / name, offset)  # mended
    out = server.output(kid, "print(x, int(a.sum()))")
    assert out.splitlines()[-1] == f"41 {EXPECTED_SUM}", out
    view = server.kernel(kid)
    assert view["state"] == "running", view
    assert view["reason"].startswith("Resumed from its checkpoint taken at"), view
