"""`laden.timer.ModelTimer`: the timing helper at the import path of the API laden mirrors (see
`laden.engine.roundpipe.timer`)."""

from laden.engine.roundpipe.timer import IterTimer, LayerTimingContext, ModelTimer

__all__ = ["IterTimer", "LayerTimingContext", "ModelTimer"]
