"""Built-in training text for the generated models' BPE tokenizer.

``make-model`` trains its tokenizer on these sentences so that nothing is downloaded. The text only
has to produce a plausible merge table over everyday English, chat markup and a little code; the
generated model's weights are random, so what it says is noise either way.
"""

from __future__ import annotations

from collections.abc import Iterator

SENTENCES: tuple[str, ...] = (
    "The quick brown fox jumps over the lazy dog near the river bank.",
    "A request waits in the queue until a batch slot frees up on the engine.",
    "Prefill computes the prompt; decode produces one token per step after that.",
    "When the prefix cache misses, the whole prompt has to be computed again.",
    "You are a helpful assistant. Answer briefly and cite your sources.",
    "Please summarise the following report in three sentences for a busy reader.",
    "What is the capital of France? The capital of France is Paris.",
    "How many tokens per second does the model produce on this machine?",
    "The operator restarted the cluster after the third node ran out of memory.",
    "Latency went up because a long prompt arrived while eight streams were decoding.",
    "Cold starts are slow: the weights must be read and the kernels warmed up first.",
    "She opened the window, listened to the rain, and wrote another chapter.",
    "In 1969 two astronauts walked on the Moon while millions watched on television.",
    "The recipe needs 200 grams of flour, 3 eggs, 50 ml of milk and a pinch of salt.",
    "Our meeting is on Tuesday at 10:30; bring the quarterly numbers and the slides.",
    "Mountains, rivers and forests cover most of the northern part of the country.",
    "Error 503: the service is unavailable, retry after a few seconds.",
    "def add(a, b):\n    return a + b\n",
    "for i in range(10):\n    print(i * i)\n",
    "SELECT request_id, ttft_ms FROM requests WHERE instance_id = 'a' ORDER BY ttft_ms DESC;",
    '{"role": "user", "content": "Hello there, how are you today?"}',
    "The tool returned a JSON object with the weather for Berlin: 18 degrees and cloudy.",
    "Thank you! Could you also translate that paragraph into German and Spanish?",
    "Machine learning models learn patterns from data rather than from explicit rules.",
    "The library closes at eight in the evening, but the reading room stays open later.",
    "Every morning the baker lights the oven at four and the first bread is ready by six.",
    "Network packets travel through routers, switches and cables to reach their destination.",
    "The committee approved the budget after a long discussion about priorities.",
    "Children played football in the park while their parents talked on the benches.",
    "A good test fails for the right reason and passes only when the code is correct.",
    "The cache stores key and value tensors so that a shared prefix is not computed twice.",
    "Scientists measured the temperature of the lake every hour for an entire year.",
    "Why was this request slow? Because it waited behind a long generation.",
    "Why did the cache miss? Because the system prompt changed at the very beginning.",
    "The train to Lyon leaves from platform nine at a quarter past seven.",
    "Music, painting and poetry were the three passions of her long and quiet life.",
    "Check the logs, then the metrics, then the traces; the traces tell you where time went.",
    "The garden was full of tomatoes, beans, roses and a very old apple tree.",
    "Numbers: zero one two three four five six seven eight nine ten eleven twelve.",
    "Questions, answers, summaries, translations and small programs are common requests.",
)

_CONNECTORS = ("and then", "because", "although", "so", "while", "after that")


def training_text(repeats: int = 3) -> Iterator[str]:
    """The sentences, then deterministic pairings of them, ``repeats`` times over.

    Pairings give the BPE trainer cross-sentence statistics; the order is fixed, so training on it
    yields the same merge table every time.
    """
    n = len(SENTENCES)
    for r in range(repeats):
        yield from SENTENCES
        for i, first in enumerate(SENTENCES):
            second = SENTENCES[(i * 7 + r + 3) % n]
            yield f"{first.rstrip('.')} {_CONNECTORS[(i + r) % len(_CONNECTORS)]} {second.lower()}"
