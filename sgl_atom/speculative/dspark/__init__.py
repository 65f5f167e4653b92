"""DSpark speculative decoding: block drafting from target taps, refined by a Markov head.

Pure torch, no SGLang import: the draft config (:mod:`.config`), the checkpoint layout
(:mod:`.weights`), the Markov refinement (:mod:`.markov`), greedy acceptance and counters
(:mod:`.accept`) and the reference draft forward (:mod:`.reference`) the server path is
tested against. The SGLang side — the ``ATOM_DSPARK`` algorithm (:mod:`.algorithm`), its
worker (:mod:`.worker`), the draft loader (:mod:`.loader`) and the draft's own KV pool
(:mod:`.pool`) — is imported only by the plugin and SGLang.
"""

from sgl_atom.speculative.dspark.accept import Acceptance, SpecStats, greedy_accept
from sgl_atom.speculative.dspark.config import DSparkConfigError, DSparkDraftConfig
from sgl_atom.speculative.dspark.markov import markov_refine, markov_step_logits

__all__ = [
    "Acceptance",
    "DSparkConfigError",
    "DSparkDraftConfig",
    "SpecStats",
    "greedy_accept",
    "markov_refine",
    "markov_step_logits",
]
