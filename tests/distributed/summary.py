"""Print one parity table from the result folders (OUT of moe_parity.py) named on the command line.

    python tests/distributed/summary.py /tmp/run/ep2 /tmp/run/etp2
"""

import json
import sys
from pathlib import Path

from _common import parity_table

ranks = [json.loads(path.read_text()) for folder in sys.argv[1:]
         for path in sorted(Path(folder).glob("rank*.json"))]
print(parity_table(ranks))
