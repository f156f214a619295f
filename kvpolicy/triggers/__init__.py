"""Built-in triggers: when a layer re-selects its retrieved KV."""

from .base import Trigger
from .every_step import EveryStep
from .interval import Interval
from .query_cosine import QueryCosine
from .score_gap import ScoreGap

__all__ = ["Trigger", "EveryStep", "Interval", "QueryCosine", "ScoreGap"]
