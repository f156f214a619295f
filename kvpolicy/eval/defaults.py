"""The evaluations' defaults, in one module that imports nothing: the library functions take them
as their defaults and the CLI shows them in its flags, without loading transformers to build its
parser. Change a default here and both follow."""

# run_grid / kvpolicy eval: the grid
GRID_LENGTHS = (2048, 4096, 8192)
GRID_BUDGETS = (256, 512, 1024)
GRID_PRESETS = ("full", "streaming", "quest", "arkvale", "clusterkv", "louiskv", "pariskv", "oracle")
GRID_SEEDS = (0, 1, 2)

# drift.run / kvpolicy drift: presets, and clusterkv-stale (drift.VARIANTS)
DRIFT_POLICIES = ("pariskv", "clusterkv-stale", "clusterkv")

# fidelity.measure / kvpolicy fidelity: tokens full attention writes
FIDELITY_NEW_TOKENS = 1024

# calibrate.measure_taus / calibrate.calibrate / kvpolicy calibrate
CALIBRATION_TAUS = (0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95)  # query_cosine's
CALIBRATION_SAMPLES = 200
CALIBRATION_LENGTH = 1024
CALIBRATION_STEPS = 32
CALIBRATION_BUDGET = 512
CALIBRATION_TOLERANCE = 0.02  # of top-1 agreement, against every-step selection's
