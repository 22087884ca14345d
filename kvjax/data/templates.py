"""Verbatim task templates (docs/benchmarks.md §1, §2), each cut into the kvpress three-way split.

For every task, ``CONTEXT + QUESTION + ANSWER_PREFIX`` is byte for byte the upstream template; the
cut falls where kvpress's ``create_huggingface_dataset.py`` cuts (§1.10).
"""

from __future__ import annotations

# RULER NIAH (§1.4). Placeholders: {type_needle_v}, {context}, {query}.
NIAH_CONTEXT = (
    "Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the {type_needle_v} afterwards.\n{context}\n"
)
NIAH_QUESTION = "What are all the special magic {type_needle_v} for {query} mentioned in the provided text?"
NIAH_ANSWER_PREFIX = " The special magic {type_needle_v} for {query} mentioned in the provided text are"
NIAH_NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."

# RULER variable tracking (§1.5). Placeholders: {context}, {query}, {num_v}.
VT_CONTEXT = "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
VT_QUESTION = "Question: Find all variables that are assigned the value {query} in the text above."
VT_ANSWER_PREFIX = (
    " Answer: According to the chain(s) of variable assignment in the text above, "
    "{num_v} variables are assigned the value {query}, they are: "
)

# RULER common words extraction (§1.6).
CWE_CONTEXT = (
    "Below is a numbered list of words. In these words, some appear more often than others. "
    "Memorize the ones that appear most often.\n{context}\n"
)
CWE_QUESTION = "Question: What are the 10 most common words in the above list?"
CWE_ANSWER_PREFIX = " Answer: The top 10 words that appear most often in the list are:"

# RULER frequent words extraction (§1.7).
FWE_CONTEXT = (
    "Read the following coded text and track the frequency of each coded word. "
    "Find the three most frequently appeared coded words. {context}\n"
)
FWE_QUESTION = (
    "Question: Do not provide any explanation. Please ignore the dots '....'. "
    "What are the three most frequently appeared words in the above coded text?"
)
FWE_ANSWER_PREFIX = " Answer: According to the coded text above, the three most frequently appeared words are:"

# RULER QA (§1.8). The trailing instruction belongs to the question.
QA_INSTRUCTION = (
    "Answer the question based on the given documents. Only give me the answer and do not output any other words."
)
QA_CONTEXT = QA_INSTRUCTION + "\n\nThe following are given documents.\n\n{context}\n\n"
QA_QUESTION = QA_INSTRUCTION + "\n\nQuestion: {query}"
QA_ANSWER_PREFIX = " Answer:"
QA_DOCUMENT = "Document {i}:\n{document}"

# Needle-in-a-haystack grid, KVCache-Factory variant (§2.2).
NIAH_GRID_NEEDLE = "\nThe best thing to do in San Francisco is eat a sandwich and sit in Dolores Park on a sunny day.\n"
NIAH_GRID_QUESTION_TEXT = "The best thing to do in San Francisco is: "
NIAH_GRID_CONTEXT = "<|im_start|> This is a very long story book: <book> {context} </book>.\n"
NIAH_GRID_QUESTION = " Based on the content of the book, Question: {retrieval_question}\n"
NIAH_GRID_ANSWER_PREFIX = "Answer:"

# Passkey retrieval (§2.4, kvjax choice).
PASSKEY_NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key."
PASSKEY_CONTEXT = (
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
    "I will quiz you about the important information there.\n{context}\n"
)
PASSKEY_QUESTION = "What is the pass key?"
PASSKEY_ANSWER_PREFIX = " The pass key is"


def singular(text: str) -> str:
    """RULER's singular rewrite for q*v == 1 (§1.4): plain replacements, in this order."""
    for old, new in (("Some", "A"), ("are all", "is"), ("are", "is"), ("answers", "answer")):
        text = text.replace(old, new)
    return text
