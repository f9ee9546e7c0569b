"""An ART•E-like agent: answer a question about the inbox with three tools, in up to three turns.

Every turn must be a tool call (`tool_choice="required"`: the grammar holds the call to one of
the tools' schemas); the last turn must be `return_final_answer`. So the format is given and what
is learned is the search and the answer: which keywords find the email, and which string in the
results is the answer (the top results are look-alike emails with other codes).

Reward: 1 for the exact answer (case and surrounding punctuation ignored); otherwise 0.25 if the
right email came back from a tool (partial credit for finding it), else 0. `--reward ruler` scores
each group with RULER instead, judged by the base model.
"""

from __future__ import annotations

import json
import sqlite3

from inbox import Question, read, search

import tempering as art


def _tool(name: str, description: str, properties: dict, required: list[str]) -> dict:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": properties, "required": required, "additionalProperties": False}}}


TOOLS = [
    _tool("search_inbox", "Find emails containing any of the keywords.", {"keywords": {"type": "string"}}, ["keywords"]),
    _tool("read_email", "Read one email.", {"email_id": {"type": "integer"}}, ["email_id"]),
    _tool("return_final_answer", "Give the answer and the ids of the emails it comes from.",
          {"answer": {"type": "string"}, "sources": {"type": "array", "items": {"type": "integer"}}}, ["answer", "sources"]),
]
SYSTEM = ("Answer the question from the user's emails. Search with keywords from the question, "
          "then give the exact answer from the matching email.")
FINAL = {"type": "function", "function": {"name": "return_final_answer"}}


def normalize(text: str) -> str:
    return text.strip().strip(".,;:!?\"'`").strip().lower()


async def rollout(model: art.Model, db: sqlite3.Connection, question: Question, *, max_turns: int = 3,
                  temperature: float = 1.0) -> art.Trajectory:
    traj = art.Trajectory(messages_and_choices=[{"role": "system", "content": SYSTEM},
                                                {"role": "user", "content": question.question}],
                          tools=TOOLS, metadata={"email_id": question.email_id})
    answer, sources, seen = None, [], set()
    for turn in range(max_turns):
        completion = await model.openai_client().chat.completions.create(
            model=model.get_inference_name(), messages=traj.messages(), tools=TOOLS, max_tokens=48,
            tool_choice=FINAL if turn == max_turns - 1 else "required", temperature=temperature)
        choice = completion.choices[0]
        traj.messages_and_choices.append(choice)
        if not choice.message.tool_calls:  # cut short by max_tokens: the call never closed
            break
        call = choice.message.tool_calls[0]
        args = json.loads(call.function.arguments)
        if call.function.name == "return_final_answer":
            answer, sources = args["answer"], args["sources"]
            break
        if call.function.name == "search_inbox":
            result = search(db, args["keywords"])
            seen.update(r["id"] for r in result)
        else:
            result = read(db, args["email_id"]) or "no email has that id"
            seen.add(args["email_id"])
        traj.messages_and_choices.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps(result)})
    correct = answer is not None and normalize(answer) == normalize(question.answer)
    found = question.email_id in seen
    traj.reward = 1.0 if correct else 0.25 if found else 0.0
    traj.metrics.update({"correct": float(correct), "found_email": float(found), "answered": float(answer is not None),
                         "cited_source": float(question.email_id in sources), "num_turns": float(turn + 1)})
    return traj
