"""DistillRecord: the target's answer to one prompt, as distill-data writes it and training reads it, and
the forms a prompt is sent in (its own module so that the data pipeline's modules share them without
importing each other)."""

from __future__ import annotations

from dataclasses import dataclass

# How a prompt reaches the target: "chat", under the model's chat template (`dspark generate --chat`, the
# OpenAI chat endpoint), or "raw", the text alone, as a `text_input` request reaches the server
# (`dspark.prompts.check_prompt`), which the target continues rather than answers in its chat format.
PROMPT_FORMS = ("chat", "raw")


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
