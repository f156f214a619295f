"""Built-in selectors: which units fill the budget."""

from .base import Selection, Selector
from .bound import Bound
from .collision_rerank import CollisionRerank
from .oracle import Oracle
from .top_budget import TopBudget

__all__ = ["Selection", "Selector", "Bound", "CollisionRerank", "Oracle", "TopBudget"]
