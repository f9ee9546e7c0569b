"""A synthetic inbox in SQLite with full-text search (FTS5), and questions answered by one email.

`build_inbox(seed)` writes a few hundred emails: fact emails (a shipment's tracking number, a
flight's confirmation code, a meeting's room, a Wi-Fi password), each the only place its answer
appears, among newsletters and chatter that use the same names. Every fact email comes with a
question and its exact answer.
"""

from __future__ import annotations

import random
import re
import sqlite3
from dataclasses import dataclass

COMPANIES = ["Northwind", "Globex", "Initech", "Umbrella", "Hooli", "Vandelay", "Wonka", "Stark", "Acme", "Soylent",
             "Cyberdyne", "Tyrell", "Wayne", "Oscorp", "Gringotts", "Monarch", "Aperture", "Duff", "Nakatomi", "Zorg"]
CITIES = ["Lisbon", "Denver", "Osaka", "Nairobi", "Oslo", "Lima", "Dublin", "Hanoi", "Austin", "Krakow",
          "Quito", "Perth", "Seville", "Tunis", "Boston", "Riga", "Accra", "Porto", "Sapporo", "Calgary"]
PROJECTS = ["Falcon", "Orchid", "Granite", "Nimbus", "Juniper", "Beacon", "Mosaic", "Tundra", "Pioneer", "Saffron",
            "Comet", "Harbor", "Quartz", "Willow", "Ember", "Atlas", "Cedar", "Vortex", "Lotus", "Summit"]
PEOPLE = ["Ana Ruiz", "Ben Okafor", "Chloe Park", "Dev Patel", "Emma Stone", "Farid Haddad", "Grace Liu", "Hugo Berg"]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday"]


@dataclass(frozen=True)
class Question:
    question: str
    answer: str
    email_id: int


def _code(rng: random.Random, letters: int, digits: int) -> str:
    return "".join(rng.choices("ABCDEFGHJKLMNPQRSTUVWXYZ", k=letters)) + "".join(rng.choices("0123456789", k=digits))


def _fact(kind: str, rng: random.Random) -> tuple[str, str, str, str, str]:
    """(sender, subject, body, question, answer) of one fact email."""
    if kind == "shipment":
        company, code = rng.choice(COMPANIES), _code(rng, 2, 3)
        return (f"orders@{company.lower()}.com", f"Your {company} order has shipped",
                (f"Good news: your {company} order is on its way. Tracking number: {code}. It should arrive by "
                f"{rng.choice(DAYS)}."), f"What is the tracking number of my {company} order?", code)
    if kind == "flight":
        city, code = rng.choice(CITIES), _code(rng, 4, 0)
        return ("bookings@skyways.com", f"Flight to {city} confirmed",
                f"Your flight to {city} on {rng.choice(DAYS)} is booked. Confirmation code: {code}.",
                f"What is the confirmation code of my flight to {city}?", code)
    if kind == "meeting":
        project, room = rng.choice(PROJECTS), _code(rng, 1, 3)
        return (f"{rng.choice(PEOPLE).split()[0].lower()}@work.com", f"{project} review",
                f"The {project} review is on {rng.choice(DAYS)} at {rng.randint(9, 16)}:00 in room {room}.",
                f"Which room is the {project} review in?", room)
    city, password = rng.choice(CITIES), rng.choice(["maple", "cobalt", "otter", "lantern", "pepper"]) + str(rng.randint(10, 99))
    return ("it@work.com", f"Wi-Fi at the {city} office",
            f"The guest Wi-Fi password at the {city} office is {password}.",
            f"What is the guest Wi-Fi password at the {city} office?", password)


def _filler(rng: random.Random) -> tuple[str, str, str]:
    """(sender, subject, body) of an email that answers no question but shares its words."""
    company, city, project = rng.choice(COMPANIES), rng.choice(CITIES), rng.choice(PROJECTS)
    return rng.choice([
        (f"news@{company.lower()}.com", f"{company} spring sale", (f"Everything at {company} is 20% off this week. "
         f"Free shipping on orders over $50.")),
        ("travel@skyways.com", f"Deals to {city}", f"Fly to {city} from $199. Book by {rng.choice(DAYS)}."),
        (f"{rng.choice(PEOPLE).split()[0].lower()}@work.com", f"Notes on {project}",
         f"Thanks for the {project} discussion. I will send the slides before {rng.choice(DAYS)}."),
        ("it@work.com", f"{city} office closed on {rng.choice(DAYS)}", (f"The {city} office is closed for maintenance. "
         f"Please work from home.")),
    ])


def build_inbox(*, num_facts: int = 60, num_filler: int = 240, seed: int = 0) -> tuple[sqlite3.Connection, list[Question]]:
    """An in-memory database with a table `emails(id, sender, subject, body)` and its FTS5 index.

    Returns the connection and one Question per fact email; no two facts share a question.
    """
    capacity = len(COMPANIES) + 2 * len(CITIES) + len(PROJECTS)  # distinct questions there can be
    if num_facts > capacity:
        raise ValueError(f"num_facts must be at most {capacity}")
    rng = random.Random(seed)
    rows: list[tuple[str, str, str]] = []
    questions: list[tuple[str, str, int]] = []
    asked: set[str] = set()
    while len(questions) < num_facts:
        sender, subject, body, question, answer = _fact(rng.choice(["shipment", "flight", "meeting", "wifi"]), rng)
        if question in asked:
            continue
        asked.add(question)
        rows.append((sender, subject, body))
        questions.append((question, answer, len(rows) - 1))
    rows += [_filler(rng) for _ in range(num_filler)]
    order = list(range(len(rows)))
    rng.shuffle(order)  # fact emails are not all at the front
    new_id = {old: new for new, old in enumerate(order, start=1)}  # row index -> email id
    db = sqlite3.connect(":memory:", check_same_thread=False)
    db.execute("CREATE TABLE emails (id INTEGER PRIMARY KEY, sender TEXT, subject TEXT, body TEXT)")
    db.executemany("INSERT INTO emails VALUES (?, ?, ?, ?)",
                   sorted((new_id[i], *row) for i, row in enumerate(rows)))
    db.execute("CREATE VIRTUAL TABLE emails_fts USING fts5(subject, body, content='emails', content_rowid='id')")
    db.execute("INSERT INTO emails_fts(rowid, subject, body) SELECT id, subject, body FROM emails")
    return db, [Question(q, a, new_id[i]) for q, a, i in questions]


def search(db: sqlite3.Connection, keywords: str, *, limit: int = 2) -> list[dict]:
    """The best `limit` emails matching any of the words in `keywords` (BM25 ranking)."""
    words = re.findall(r"[A-Za-z0-9]+", keywords)
    if not words:
        return []
    query = " OR ".join(f'"{w}"' for w in words)
    rows = db.execute("SELECT rowid, subject, snippet(emails_fts, 1, '', '', '...', 12) FROM emails_fts "
                      "WHERE emails_fts MATCH ? ORDER BY bm25(emails_fts) LIMIT ?", (query, limit)).fetchall()
    return [{"id": i, "subject": subject, "snippet": snippet} for i, subject, snippet in rows]


def read(db: sqlite3.Connection, email_id: int) -> dict | None:
    row = db.execute("SELECT id, sender, subject, body FROM emails WHERE id = ?", (email_id,)).fetchone()
    return dict(zip(("id", "from", "subject", "body"), row)) if row else None
