"""Built-in unit builders: how KV is grouped into retrievable units."""

from .base import UnitBuilder
from .kmeans import KMeans
from .pages import Pages
from .segments import Segments
from .table import UnitTable

__all__ = ["UnitBuilder", "KMeans", "Pages", "Segments", "UnitTable"]
