"""radiance_ar.transport.side_lanes.DecodeLane with stand-in streams and events (no GPU
here): when kernels go on the lane, and when the caller joins it."""

import contextlib

import pytest
import torch

from radiance_ar.transport import side_lanes
from radiance_ar.transport.side_lanes import DecodeLane


class Stream:
    def __init__(self, name, log):
        self.name, self.cuda_stream, self.log = name, hash(name), log

    def wait_event(self, event):
        self.log.append(f"{self.name} waits")


class Event:
    def __init__(self, log):
        self.log = log

    def record(self, stream):
        self.log.append(f"{stream.name} records")


@pytest.fixture
def lane(monkeypatch):
    log = []
    monkeypatch.setattr(side_lanes, "dedicated_stream", lambda device, **kw: Stream("lane", log))
    monkeypatch.setattr(torch.cuda, "Event", lambda: Event(log))
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    caller = Stream("caller", log)
    return DecodeLane(torch.device("cuda", 0), lambda: caller), caller, log


def test_the_lane_is_used_only_inside_a_block_and_joined_once_at_its_outer_end(lane):
    decode, caller, log = lane
    assert not decode.active
    with decode.block():
        with decode.block():  # nested: the outer end joins
            assert decode.active
            with decode.current(caller):
                pass
        assert log == ["caller records", "lane waits"]
    assert log[2:] == ["lane records", "caller waits"] and not decode.active


def test_off_while_keeps_kernels_off_the_lane_and_restores_on_every_path(lane):
    decode, _, _ = lane
    with decode.block():
        with decode.off_while(True):
            with decode.off_while(False):  # nested: still off
                assert not decode.active
            assert not decode.active
        assert decode.active
        with pytest.raises(RuntimeError), decode.off_while(True):
            raise RuntimeError("capture failed")
        assert decode.active
