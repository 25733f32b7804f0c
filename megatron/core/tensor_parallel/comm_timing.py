"""An optional observer of the tensor-parallel collectives (the all-reduces and all-gathers of mappings.py and
the vocabulary-parallel cross entropy), so that the training timers can count the time the compute stream spends
blocked in them without synchronizing the device per collective.

With no observer installed (the default, and always outside training with --timing-log-level >= 1) begin() returns
None and end() returns at once. An observer has begin() -> token and end(token); training's PhaseClock records a
CUDA event (or the host clock on CPU) at each.
"""
_observer = None


def set_collective_observer(observer):
    """Installs `observer` (None removes it); returns the previous one."""
    global _observer
    previous, _observer = _observer, observer
    return previous


def begin():
    return None if _observer is None else _observer.begin()


def end(token):
    if token is not None and _observer is not None:
        _observer.end(token)
