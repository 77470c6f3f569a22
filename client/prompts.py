"""`dspark-client bench`'s prompts: everyday questions, one user turn each (a module of their own,
without the client's dependencies, so that scripts on a bare machine can read them too)."""

PROMPTS = [
    "Explain how a bicycle stays upright.",
    "Write a short poem about the sea.",
    "What are the three primary colors?",
    "Describe the water cycle in simple terms.",
    "Give three tips for learning a new language.",
    "Why is the sky blue?",
    "Summarize the plot of Romeo and Juliet.",
    "How does a refrigerator keep food cold?",
]
