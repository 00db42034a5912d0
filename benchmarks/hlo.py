"""Reading collectives out of compiled HLO text: the benchmarks' name for `funshard._hlo`.

The parser lives in the library (`funshard/_hlo.py`), where `fs.check`-style readings of a
compiled step need it; the FSDP benchmark (`benchmarks/fsdp/`) and the tests
(`tests/_hlo.py`, which load this file by path, without the benchmark package and its
device setup) keep reading it under this name.

* `computations(text)`: the module's computations, name -> instruction lines.
* `parse_collectives(lines)`: every collective instruction, as `Collective` records.
* `executed_collectives(text, num_devices)`: what ONE step runs per device: each
  collective with the number of times it executes and its bytes.
"""

from funshard._hlo import KINDS as KINDS
from funshard._hlo import Collective as Collective
from funshard._hlo import computations as computations
from funshard._hlo import dtype_bytes as dtype_bytes
from funshard._hlo import executed_collectives as executed_collectives
from funshard._hlo import multiplicities as multiplicities
from funshard._hlo import parse_collectives as parse_collectives
