"""copy_engine.dedicated_stream with stand-in runtimes (no GPU here): the create call's
flag, the handle the torch object wraps, and when the raw stream is destroyed."""

import contextlib
import gc

import pytest
import torch

from radiance_ar.transport import copy_engine


class Raw:
    """A bindings handle object: converts to its integer."""

    def __init__(self, handle):
        self.handle = handle

    def __int__(self):
        return self.handle


class Wrapped:
    """Stands for torch.cuda.ExternalStream: keeps the handle it wraps."""

    def __init__(self, handle, device):
        self.cuda_stream, self.device = handle, device


@pytest.fixture
def runtimes(monkeypatch):
    """Stand-in CUDA and HIP runtimes; yields (created flags, destroyed handles)."""
    created, destroyed = [], []

    def create(flags):
        created.append(flags)
        return 0, Raw(0x1000 + len(created))

    def destroy(raw):
        destroyed.append(raw)
        return (0,)

    runtime = type("Runtime", (), {"cudaStreamCreateWithFlags": staticmethod(create),
                                   "cudaStreamDestroy": staticmethod(destroy)})
    hip = type("Hip", (), {"hipStreamCreateWithFlags": staticmethod(create),
                           "hipStreamDestroy": staticmethod(destroy)})
    monkeypatch.setattr(copy_engine, "_cuda", lambda: (None, runtime))
    monkeypatch.setattr(copy_engine, "_hip", lambda: hip)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "ExternalStream", Wrapped)
    yield created, destroyed


@pytest.mark.parametrize("hip_version", [None, "6.4"])
def test_a_dedicated_stream_is_made_non_blocking_and_destroyed_with_its_object(
        runtimes, monkeypatch, hip_version):
    """Each platform's create call gets the non-blocking flag, the torch object wraps the
    new handle, and the raw stream is destroyed once that object is collected (not while
    the interpreter shuts down); a CPU device is refused."""
    created, destroyed = runtimes
    monkeypatch.setattr(torch.version, "hip", hip_version)
    stream = copy_engine.dedicated_stream(torch.device("cuda", 0))
    other = copy_engine.dedicated_stream(torch.device("cuda", 0))
    assert created == [copy_engine.STREAM_NON_BLOCKING] * 2
    assert stream.cuda_stream == 0x1001 and other.cuda_stream == 0x1002
    assert destroyed == []
    del stream
    gc.collect()
    assert destroyed == [0x1001]
    del other
    gc.collect()
    assert destroyed == [0x1001, 0x1002]
    with monkeypatch.context() as m:  # interpreter shutdown: the driver cleans up
        m.setattr(copy_engine.sys, "is_finalizing", lambda: True)
        late = copy_engine.dedicated_stream(torch.device("cuda", 0))
        assert isinstance(late, Wrapped)
        del late
        gc.collect()
    assert destroyed == [0x1001, 0x1002]
    with pytest.raises(ValueError, match="has no streams"):
        copy_engine.dedicated_stream(torch.device("cpu"))


def test_a_stream_the_torch_object_could_not_wrap_is_destroyed_at_once(runtimes,
                                                                       monkeypatch):
    created, destroyed = runtimes
    monkeypatch.setattr(torch.version, "hip", None)

    class Refusing(Wrapped):
        def __init__(self, handle, device):
            raise RuntimeError("no such device")

    monkeypatch.setattr(torch.cuda, "ExternalStream", Refusing)
    with pytest.raises(RuntimeError, match="no such device"):
        copy_engine.dedicated_stream(torch.device("cuda", 0))
    gc.collect()
    assert destroyed == [0x1001]  # once: by the error path, not again by __del__
