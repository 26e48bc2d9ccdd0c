"""Verifiable 0/1 rewards for math word problems with a numeric final answer (GSM8K and alike).

Plain Python, no torch. None of these functions raises, on any string: a reward function that
throws ends a training run hours in. Every pattern is linear-time (no nested quantifiers), so a
100,000-character completion costs milliseconds, not a catastrophic regex backtrack.
"""

import re
from decimal import Decimal

# A number as people write it: optional minus, digits with optional thousands commas, optional decimals.
NUMBER = re.compile(r"-?[0-9][0-9,]*(?:\.[0-9]+)?")
PLAIN_NUMBER = re.compile(r"-?[0-9]+(?:\.[0-9]+)?")
BOXED_OR_BRACE = re.compile(r"\\boxed\{|[{}]")


def extract_gold(answer_field: str) -> str:
    """GSM8K gold answers end with '#### N': return N as written after the *last* '####'."""
    _, _, final = answer_field.rpartition("####")
    return final.strip()


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} whose braces close, matched in one pass with a stack."""
    stack, last_start, content = [], -1, None
    for match in BOXED_OR_BRACE.finditer(text):
        if match.group() == "}":
            if stack:
                opened_at, is_boxed = stack.pop()
                if is_boxed and opened_at > last_start:
                    last_start, content = opened_at, text[opened_at : match.start()]
        else:
            stack.append((match.end(), match.group() != "{"))
    return content


def extract_answer(completion: str) -> str | None:
    """The model's final answer: the last \\boxed{}, else the last <answer>…</answer>,
    else the first number after the last '####', else the last number in the text; None if none."""
    boxed = last_boxed(completion)
    if boxed is not None:
        return boxed.strip()
    close = completion.rfind("</answer>")
    open_ = completion.rfind("<answer>", 0, close) if close >= 0 else -1
    if open_ >= 0:
        return completion[open_ + len("<answer>") : close].strip()
    hashes = completion.rfind("####")
    if hashes >= 0:
        number = NUMBER.search(completion, hashes)
        if number:
            return number.group()
    numbers = NUMBER.findall(completion)
    return numbers[-1] if numbers else None


def to_number(text: str) -> Decimal | None:
    """'$1,234.50' -> 1234.50; '18.' -> 18; '18 apples' -> 18 (the last number in it); else None."""
    cleaned = text.replace(",", "").replace("$", "").replace("%", "").strip().rstrip(".")
    if not PLAIN_NUMBER.fullmatch(cleaned):
        numbers = PLAIN_NUMBER.findall(cleaned)
        if not numbers:
            return None
        cleaned = numbers[-1]
    return Decimal(cleaned)


def reward(completion: str, gold: str) -> float:
    """1.0 if the completion's final answer equals the gold number (18.00 == 18, 1,234 == 1234), else 0.0.
    Whole numbers only: '118' does not earn credit for 18."""
    answer = extract_answer(completion)
    if answer is None:
        return 0.0
    predicted, expected = to_number(answer), to_number(gold)
    if predicted is None or expected is None:
        return float(answer == gold.strip() and answer != "")
    return float(predicted == expected)
