"""What a forward pass records for the eviction policies (DESIGN.md, "Observations a policy may ask for").

One module per observation: its keyword, fields and shapes, what it needs from attention, and the code
that records it (`base.Observation`). `ObservationSpec` (what to record) and `Observations` (what was
recorded) loop over them generically (`spec`). The lines below register the observations the forward
records; producers, passes the engine runs after the prefill, live above the model in `kvjax.passes`
(KVzip's reconstruction, LookaheadKV's tokens) and register when their policy imports them.
"""

from kvjax.observations.base import REGISTRY, CallView, LayerView, Observation
from kvjax.observations.spec import Observations, ObservationSpec

# the observations the forward records: one line each
from kvjax.observations.window_queries import WindowQueries  # noqa: E402
from kvjax.observations.column_mass import ColumnMass  # noqa: E402
from kvjax.observations.step_probs import StepProbs  # noqa: E402
from kvjax.observations.output_norms import OutputNorms, OutputNormsL2, OutputNormsRMS  # noqa: E402
from kvjax.observations.query_stats import QueryStats  # noqa: E402
from kvjax.observations.query_mass import QueryMass  # noqa: E402
from kvjax.observations.query_moments import QueryMoments  # noqa: E402

__all__ = ["REGISTRY", "CallView", "ColumnMass", "LayerView", "Observation", "ObservationSpec", "Observations",
           "OutputNorms", "OutputNormsL2", "OutputNormsRMS", "QueryMass", "QueryMoments", "QueryStats", "StepProbs",
           "WindowQueries"]
