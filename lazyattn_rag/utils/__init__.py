"""Console helpers every layer may import (progress of long steps, sizes, plurals)."""
