"""What is trained: the objective a module holds (:class:`Objective`): SFT, the pair losses, KTO,
or a user's own subclass."""

from lit_instruct.objectives.base import Objective, ObjectiveSums, Policy
from lit_instruct.objectives.choice import OBJECTIVES, ObjectiveName, resolve_objective
from lit_instruct.objectives.kto import KTO
from lit_instruct.objectives.online import GRPO, RLOO
from lit_instruct.objectives.pairs import DPO, IPO, ORPO, PairObjective, SimPO
from lit_instruct.objectives.sft import SFT

__all__ = [
    "DPO",
    "GRPO",
    "IPO",
    "KTO",
    "OBJECTIVES",
    "ORPO",
    "RLOO",
    "SFT",
    "Objective",
    "ObjectiveName",
    "ObjectiveSums",
    "PairObjective",
    "Policy",
    "SimPO",
    "resolve_objective",
]
