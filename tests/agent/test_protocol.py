"""The wire format and the records' bounds, in process (no root, no agent)."""

from __future__ import annotations

import asyncio
import json
import struct

import pytest

from jupyter_cedana.agent import protocol
from jupyter_cedana.agent.kernels import KernelLog, KernelRecord, KernelTable
from jupyter_cedana.agent.protocol import AgentError, FrameError


def read(data: bytes, *, eof: bool = True, limit: int = 1024, timeout: float = 5) -> object:
    async def go() -> object:
        reader = asyncio.StreamReader()
        reader.feed_data(data)
        if eof:
            reader.feed_eof()
        return await protocol.read_frame(reader, limit, timeout)

    return asyncio.run(go())


def test_round_trip() -> None:
    obj = {"v": 1, "id": 3, "op": "hello", "args": {"text": "é"}}
    frame = protocol.encode(obj, 1024)
    assert struct.unpack(">I", frame[:4])[0] == len(frame) - 4
    assert read(frame) == obj
    assert read(b"") is None  # a clean end between frames


def test_encode_refuses_what_the_peer_would_refuse() -> None:
    with pytest.raises(AgentError) as e:
        protocol.encode({"x": "y" * 100}, 50)
    assert e.value.code == "too_large"


@pytest.mark.parametrize(
    "data,code",
    [
        (struct.pack(">I", 1025), "too_large"),
        (struct.pack(">I", 5) + b"{not", "bad_request"),  # closed inside the frame
        (struct.pack(">I", 4) + b"{no}", "bad_request"),
        (struct.pack(">I", 2) + b"[]", "bad_request"),
        (struct.pack(">I", 2) + b"\xff\xff", "bad_request"),
        (b"\x00\x00", "bad_request"),
    ],
)
def test_bad_frames(data: bytes, code: str) -> None:
    with pytest.raises(FrameError) as e:
        read(data)
    assert e.value.code == code


def test_a_stalled_frame_times_out() -> None:
    with pytest.raises(FrameError) as e:
        read(struct.pack(">I", 10) + b"{", eof=False, timeout=0.2)
    assert e.value.code == "timeout"


def test_the_length_is_checked_before_the_body_is_read() -> None:
    # Only the header arrives and the stream stays open: the refusal cannot have waited.
    with pytest.raises(FrameError) as e:
        read(struct.pack(">I", 1 << 31), eof=False, timeout=30)
    assert e.value.code == "too_large"


@pytest.mark.parametrize(
    "value", ["../etc", "ABC", "a" * 65, "", "a/b", "a\x00", 5, None, ["a"], "id with space"]
)
def test_kernel_ids_are_validated(value: object) -> None:
    with pytest.raises(AgentError) as e:
        protocol.kernel_id({"kernel_id": value})
    assert e.value.code == "bad_request"


def test_kernel_id_accepts_uuids() -> None:
    kid = "0b6f8a52-3f36-4a57-9a0e-53c1d3a6a2f1"
    assert protocol.kernel_id({"kernel_id": kid}) == kid


def test_error_codes_are_a_closed_list() -> None:
    with pytest.raises(ValueError):
        AgentError("oops", "not a code")
    assert json.loads(json.dumps(AgentError("busy", "m").to_json())) == {
        "code": "busy",
        "message": "m",
    }


def test_log_keeps_the_tail_within_its_limit() -> None:
    log = KernelLog(limit=10)
    for chunk in (b"abc", b"defghij", b"klmnop"):
        log.feed(chunk)
    assert log.tail() == b"ghijklmnop"
    assert log.dropped == 6
    assert log.tail(3) == b"nop"
    assert log.tail(0) == b""


def _record(uid: int, kid: str) -> KernelRecord:
    return KernelRecord(uid=uid, kernel_id=kid, gid=uid, groups=(uid,), init_pid=0, process=None)


def test_records_are_per_uid() -> None:
    async def go() -> None:
        table = KernelTable(max_per_uid=2)
        table.reserve(_record(1001, "a"))
        with pytest.raises(AgentError) as e:
            table.lookup(1002, "a")
        assert e.value.code == "not_found"
        assert e.value.message == "no kernel a"  # the same words as for an id never used
        table.reserve(_record(1002, "a"))  # ids are per uid
        with pytest.raises(AgentError) as e:
            table.reserve(_record(1001, "a"))
        assert e.value.code == "conflict"
        table.reserve(_record(1001, "b"))
        with pytest.raises(AgentError) as e:
            table.reserve(_record(1001, "c"))
        assert e.value.code == "busy"
        assert {r.kernel_id for r in table.for_uid(1001)} == {"a", "b"}

    asyncio.run(go())
