"""The structured-output workload of structured_bench.py and its llama.cpp reference
(structured_llamacpp_ref.py): JSON schemas, prompt templates, and the Spec-Bench passages they
are filled with, and the validity check. No specrs import, so the reference runs in
llama-cpp-python's venv (with jsonschema).
"""

import json

import jsonschema

CATEGORIES = ("summarization", "rag")

EXTRACT_SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 80},
        "topic": {"type": "string", "maxLength": 40},
        "key_points": {"type": "array", "items": {"type": "string", "maxLength": 120}, "minItems": 3,
                       "maxItems": 3},
        "entities": {"type": "array", "items": {"type": "string", "maxLength": 40}, "maxItems": 5},
        "sentiment": {"enum": ["positive", "neutral", "negative"]},
    },
    "required": ["title", "topic", "key_points", "entities", "sentiment"],
    "additionalProperties": False,
}
TOOL_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"const": "search_documents"},
        "arguments": {
            "type": "object",
            "properties": {
                "query": {"type": "string", "maxLength": 80},
                "max_results": {"type": "integer", "minimum": 1, "maximum": 10},
                "filters": {
                    "type": "object",
                    "properties": {
                        "category": {"enum": ["news", "science", "history", "business", "other"]},
                        "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
                    },
                    "required": ["category", "year"],
                    "additionalProperties": False,
                },
            },
            "required": ["query", "max_results", "filters"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "arguments"],
    "additionalProperties": False,
}
TASKS = {
    "extract": (EXTRACT_SCHEMA, "Read the passage and extract its title, topic, three key points, the named "
                "entities and the overall sentiment as a JSON object.\n\nPassage:\n{passage}"),
    "tool_call": (TOOL_SCHEMA, "You can call the tool search_documents(query, max_results, filters: {{category, "
                  "year}}). Write, as JSON, the call that finds more documents on the subject of this passage."
                  "\n\nPassage:\n{passage}"),
}

def load_passages(path: str, per_category: int, max_chars: int) -> list[dict]:
    passages = {c: [] for c in CATEGORIES}
    with open(path) as f:
        for line in f:
            q = json.loads(line)
            if q["category"] in passages and len(passages[q["category"]]) < per_category:
                passages[q["category"]].append({"question_id": q["question_id"], "category": q["category"],
                                                "passage": q["turns"][0][:max_chars]})
    return [p for c in CATEGORIES for p in passages[c]]


def valid(text: str, schema: dict) -> bool:
    """Whether an output parses as JSON and validates against its schema."""
    try:
        jsonschema.validate(json.loads(text), schema)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False
