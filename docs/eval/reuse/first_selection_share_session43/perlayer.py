"""Per-layer re-selection shares of the louiskv preset on eval cells (exploration, session 43)."""
import json, sys
from kvpolicy.integrations import transformers as integ
orig = integ.PolicySession.stats
rows = []
def stats(self):
    s = orig(self)
    states = self.cache.policy_layers()
    steps = states[0].decode_steps
    rows.append([int(st.reselections.sum()) / steps for st in states])
    with open(sys.argv[1], "a") as f:  # a row a cell: its decode steps, each layer's re-selections per step
        f.write(json.dumps({"steps": steps, "per_layer": rows[-1]}) + "\n")
    return s
integ.PolicySession.stats = stats
from kvpolicy.cli import main
sys.exit(main(sys.argv[2:]))
