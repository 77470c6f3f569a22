"""DistillRecord: the target's answer to one prompt, as distill-data writes it and training reads it
(its own module so that the data pipeline's modules share it without importing each other)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class DistillRecord:
    """The target's response to one prompt: prompt_ids then response_ids (EOS included when produced)."""

    id: str
    domain: str
    temperature: float
    prompt_ids: list[int]
    response_ids: list[int]
    # The prompt's source (document, module, word list), carried into shards for provenance.
    source: str = ""
    # The prompt's key (`Prompt.key`: the unit held out whole); the id when none is known.
    key: str = ""

    def __post_init__(self) -> None:
        self.key = self.key or self.id

    @property
    def token_ids(self) -> list[int]:
        """Prompt and response as one sequence."""
        return self.prompt_ids + self.response_ids
