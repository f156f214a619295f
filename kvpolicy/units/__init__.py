"""Built-in unit builders: how KV is grouped into retrievable units."""

from .analytic import Analytic
from .analytic_index import AnalyticIndex
from .base import UnitBuilder
from .kmeans import KMeans
from .nearest_centroid import NearestCentroid
from .pages import Pages
from .segments import Segments
from .table import UnitTable

__all__ = ["UnitBuilder", "Analytic", "AnalyticIndex", "KMeans", "NearestCentroid", "Pages", "Segments", "UnitTable"]
