"""Texts for the demo: a long system prompt, a long document and questions about both.

Written for this project; deterministic, so every run of the demo sees the
same prompts.
"""
from __future__ import annotations

import random

SYSTEM_PROMPT = """You are Atlas, the support assistant of Northwind Outfitters, a retailer of outdoor gear.
Follow these rules in every answer.
1. Be concise: answer in at most three sentences unless the customer asks for detail.
2. Never invent order numbers, prices, stock levels or delivery dates. If you do not know, say so and offer to check.
3. Returns are accepted within 60 days of delivery for unused items in their original packaging. Worn footwear can be returned within 14 days if it was worn indoors only.
4. Refunds go back to the original payment method within 5 to 7 business days after the warehouse receives the item.
5. Exchanges for a different size are free; exchanges for a different product are treated as a return plus a new order.
6. Shipping is free on orders above 75 dollars within the contiguous United States. Express shipping costs 19 dollars and arrives in two business days.
7. We ship to Canada and Mexico; customs duties are paid by the customer and are not refundable.
8. Warranty: tents, backpacks and sleeping bags carry a lifetime warranty against manufacturing defects; electronics carry a two-year warranty.
9. Repairs: the repair centre in Portland fixes zippers, seams and buckles for free on items under warranty and for a flat fee of 25 dollars otherwise.
10. Loyalty programme: members earn one point per dollar; 500 points give a 25 dollar voucher. Points expire after 18 months without a purchase.
11. Safety: never advise a customer on avalanche terrain, glacier travel or technical climbing beyond pointing them to a certified guide.
12. Escalate to a human agent when the customer is angry after two replies, mentions a legal claim, or reports an injury.
13. Do not discuss competitors' products or prices.
14. When the customer asks for product advice, ask about the season, the expected temperatures and the weight they are willing to carry before recommending anything.
15. Use the customer's name if they gave it, and close with an offer of further help.
"""

QUESTIONS = [
    "Can I return boots I wore on one short hike?",
    "How long does a refund take to reach my card?",
    "Do you ship to Toronto, and who pays the duties?",
    "My tent zipper broke after three years. What can you do?",
    "How many points do I need for a voucher?",
    "Is express shipping available to Texas and how much is it?",
    "I want a different size of the same jacket. Is that free?",
    "Which sleeping bag should I buy for a winter trip?",
    "Can you tell me if the glacier route on Mount Baker is safe this week?",
    "Do my loyalty points expire?",
]

_TOPICS = ["the Ridgeline 55 backpack", "the Cirrus two-person tent", "the Ember down sleeping bag",
           "the Trailhead headlamp", "the Summit trekking poles", "the Basin water filter"]
_FACTS = [
    "weighs {w} grams in its standard configuration",
    "was redesigned in {y} after field tests in the Cascades",
    "uses a {m} fabric rated for {r} hours of ultraviolet exposure",
    "ships with a repair kit containing {n} patches and a spare buckle",
    "passed a drop test from {h} metres without damage",
    "is assembled in a factory that audits its suppliers every {k} months",
]


def build_document(num_paragraphs: int = 24, seed: int = 7) -> str:
    """A product manual long enough to span many KV blocks."""
    rng = random.Random(seed)
    paragraphs = []
    for i in range(num_paragraphs):
        topic = _TOPICS[i % len(_TOPICS)]
        facts = rng.sample(_FACTS, 3)
        sentences = [f"Section {i + 1} covers {topic}."]
        for fact in facts:
            sentences.append("It " + fact.format(
                w=rng.randint(180, 2400), y=rng.randint(2015, 2025), m=rng.choice(["ripstop", "nylon", "canvas"]),
                r=rng.randint(200, 900), n=rng.randint(2, 9), h=rng.randint(1, 5), k=rng.randint(3, 18)) + ".")
        paragraphs.append(" ".join(sentences))
    return "\n\n".join(paragraphs)


DOC_QUESTIONS = [
    "How much does the Ridgeline 55 backpack weigh?",
    "When was the Cirrus tent redesigned?",
    "What fabric does the Ember sleeping bag use?",
    "How many patches come with the headlamp repair kit?",
    "From what height was the water filter drop-tested?",
    "How often are suppliers of the trekking poles audited?",
    "Which product is covered in section 12?",
    "Summarise the warranty-relevant facts in two sentences.",
]
