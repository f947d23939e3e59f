"""`tirl analyze`: the paper's Section 7 analysis of high-entropy tokens in tool-using trajectories.

`entropy` recomputes the policy's token entropy over saved trajectories (teacher forcing);
`forking` picks the top share of tokens by entropy and tells forking tokens (inside the model's own
reasoning) from reflection tokens (right after a tool response); `report` writes markdown and plots.
"""

from tirl.analysis.entropy import AnalyzedTrajectory, read_trajectories, token_entropies
from tirl.analysis.forking import HighEntropyTokens, classify_positions, high_entropy_tokens
from tirl.analysis.report import analyze

__all__ = [
    "AnalyzedTrajectory",
    "HighEntropyTokens",
    "analyze",
    "classify_positions",
    "high_entropy_tokens",
    "read_trajectories",
    "token_entropies",
]
