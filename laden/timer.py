"""`laden.timer.ModelTimer`: the timing helper at the import path of the API laden mirrors (see
`laden.roundpipe.timer`)."""

from laden.roundpipe.timer import IterTimer, LayerTimingContext, ModelTimer

__all__ = ["IterTimer", "LayerTimingContext", "ModelTimer"]
