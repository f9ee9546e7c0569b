"""An ART•E-like agent: answer a question about the inbox with three tools, in up to three turns.

Every turn is a tool call whose arguments the grammar holds to the tool's schema: turn 1 must
be `search_inbox` (one to four keywords), turn 2 any tool (search again, read an email or
answer), turn 3 `return_final_answer` (a one-word answer). So the format is given, and what is
learned is the search and the answer: which keywords find the email (the model likes to mangle
names, "Tunisian" for "Tunis"), and which string in the results is the answer (the other
results are look-alike emails with other codes). Two worked examples (a question, its search and
its answer) come before the real question.

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


# Every string and list is bounded so that each forced call can close within max_tokens (an
# unbounded string let the sampled model run on, e.g. "A-Za-z0-9-A-Za-...", until the call was cut).
WORDS = "^[A-Za-z0-9-]{1,20}( [A-Za-z0-9-]{1,20}){0,3}$"  # one to four words: a search is a few keywords
TOOLS = [
    _tool("search_inbox", "Find emails containing any of the keywords.",
          {"keywords": {"type": "string", "pattern": WORDS}}, ["keywords"]),
    _tool("read_email", "Read one email.", {"email_id": {"type": "integer"}}, ["email_id"]),
    _tool("return_final_answer", "Give the answer (one word) and the ids of the emails it comes from.",
          {"answer": {"type": "string", "pattern": "^[A-Za-z0-9-]{1,20}$"},
           "sources": {"type": "array", "items": {"type": "integer"}, "maxItems": 3}}, ["answer", "sources"]),
]
SYSTEM = "Answer the question from the user's emails: search for the name in it, then answer with the code you find."


def _worked_example(n: int, question: str, keywords: str, results: str, answer: str, source: int) -> list[dict]:
    """The five messages of worked example `n` (0, 1, ...): the question, a search, its results, the answer."""
    search_id, answer_id = f"call_{2 * n + 1}", f"call_{2 * n + 2}"

    def call(call_id: str, name: str, arguments: dict) -> dict:
        return {"role": "assistant", "content": "", "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}]}

    return [
        {"role": "user", "content": question},
        call(search_id, "search_inbox", {"keywords": keywords}),
        {"role": "tool", "tool_call_id": search_id, "content": results},
        call(answer_id, "return_final_answer", {"answer": answer, "sources": [source]}),
        {"role": "tool", "tool_call_id": answer_id, "content": "ok"},
    ]


# Two worked examples before the real question (the 135M model imitates an example far better
# than it follows a description). Their names (Contoso, Madrid) are in no email, so an example's
# answer is never right for a real question. These turns are context, not trained.
EXAMPLES = [
    *_worked_example(0, "What is the tracking number of my Contoso order?", "Contoso order",
                     "[12] Your Contoso order has shipped: ...your Contoso order is on its way. Tracking number: "
                     "KX123. It should...\n[40] Contoso spring sale: Everything at Contoso is 20% off this week.",
                     "KX123", 12),
    *_worked_example(1, "What is the confirmation code of my flight to Madrid?", "flight Madrid",
                     "[7] Deals to Madrid: Fly to Madrid from $199. Book by Friday.\n[31] Flight to Madrid confirmed: "
                     "Your flight to Madrid on Monday is booked. Confirmation code: TRQW.", "TRQW", 31),
]
SEARCH = {"type": "function", "function": {"name": "search_inbox"}}
FINAL = {"type": "function", "function": {"name": "return_final_answer"}}


def normalize(text: str) -> str:
    return text.strip().strip(".,;:!?\"'`").strip().lower()


async def rollout(model: art.Model, db: sqlite3.Connection, question: Question, *, max_turns: int = 3,
                  temperature: float = 0.7) -> art.Trajectory:
    traj = art.Trajectory(messages_and_choices=[{"role": "system", "content": SYSTEM}, *EXAMPLES,
                                                {"role": "user", "content": question.question}],
                          tools=TOOLS, metadata={"email_id": question.email_id})
    answer, sources, seen = None, [], set()
    for turn in range(max_turns):
        completion = await model.openai_client().chat.completions.create(
            model=model.get_inference_name(), messages=traj.messages(), tools=TOOLS, max_tokens=128,
            tool_choice=SEARCH if turn == 0 else FINAL if turn == max_turns - 1 else "required", temperature=temperature)
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
            results = search(db, args["keywords"])
            seen.update(r["id"] for r in results)
            result = "\n".join(f"[{r['id']}] {r['subject']}: {r['snippet']}" for r in results) or "no email matches"
        else:
            email = read(db, args["email_id"])
            seen.add(args["email_id"])
            result = f"[{email['id']}] from {email['from']}, {email['subject']}: {email['body']}" if email else "no such email"
        traj.messages_and_choices.append({"role": "tool", "tool_call_id": call.id, "content": result})
    correct = answer is not None and normalize(answer) == normalize(question.answer)
    found = question.email_id in seen
    traj.reward = 1.0 if correct else 0.25 if found else 0.0
    traj.metrics.update({"correct": float(correct), "found_email": float(found), "answered": float(answer is not None),
                         "cited_source": float(question.email_id in sources), "num_turns": float(turn + 1)})
    return traj
