"""The "image" kind: text stand-ins for image prompts, built the way LLaVA's instruction data was.

LLaVA gave a text-only model what it "sees" of a picture as several captions plus an object list
with normalised boxes [x1, y1, x2, y2] (x to the right, y down, values in 0..1), and asked for a
detailed description, reasoning, or an answer in a conversation. Here the scenes come from this
module's own vocabulary: a scene type (kitchen, street, ...) lists its settings, people, activities
and object types with attributes and where in the frame they tend to sit; a seeded draw places the
objects, writes captions in a few annotators' styles, adds region descriptions and asks one
instruction. Evaluation and calibration use different scene types.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from .common import CALIBRATION, EVALUATION, Count, Row, Window, longest_fit, same_draws

KIND = "image"
WINDOWS = {EVALUATION: Window(450, 1450), CALIBRATION: Window(420, 1020)}
NUMBERS = ("no", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten")


@dataclass(frozen=True)
class Thing:
    """An object type: where its box tends to sit (top edge range), how wide, how tall per width."""

    name: str
    attrs: tuple[str, ...]
    place: str  # "on the counter": how a region description locates it
    top: tuple[float, float] = (0.3, 0.7)
    width: tuple[float, float] = (0.05, 0.2)
    aspect: tuple[float, float] = (0.6, 1.4)
    most: int = 3
    plural: str = ""

    @property
    def many(self) -> str:
        return self.plural or self.name + "s"


@dataclass(frozen=True)
class SceneType:
    name: str
    settings: tuple[str, ...]
    people: tuple[str, ...]  # "a woman in a green apron"
    activities: tuple[str, ...]  # "chopping vegetables"
    things: tuple[Thing, ...]
    reasoning: tuple[str, ...]  # scene-specific "complex reasoning" questions
    light: tuple[str, ...] = ("bright daylight", "soft evening light", "overcast light")


def T(name: str, attrs: str, place: str, **kw) -> Thing:
    return Thing(name, tuple(a.strip() for a in attrs.split(",")), place, **kw)


FLOOR, WALL, TABLE, SKY = (0.55, 0.8), (0.05, 0.35), (0.35, 0.6), (0.0, 0.15)

SCENES = {
    # ---------------------------------------------------------------- evaluation scene types
    "kitchen": SceneType(
        "kitchen",
        ("a small home kitchen", "a bright, modern kitchen with white cabinets", "a cluttered apartment kitchen"),
        ("a woman in a green apron", "a man wearing glasses", "a teenage boy in a hoodie", "an older woman with grey hair"),
        ("chopping vegetables", "stirring a pot on the stove", "washing dishes at the sink", "reading a recipe on a tablet",
         "pouring coffee"),
        (T("cup", "white, blue, chipped, steaming", "on the counter", top=TABLE, width=(0.03, 0.06), most=4),
         T("bowl", "ceramic, wooden, large, empty", "on the counter", top=TABLE, width=(0.06, 0.12)),
         T("knife", "large, serrated, steel", "on the cutting board", top=TABLE, width=(0.05, 0.1), aspect=(0.2, 0.4)),
         T("oven", "stainless steel, black, built-in", "below the counter", top=(0.5, 0.6), width=(0.2, 0.3), most=1),
         T("refrigerator", "tall, silver, white", "against the wall", top=(0.05, 0.15), width=(0.15, 0.25), aspect=(2.5, 3.5), most=1),
         T("sink", "double, steel, full", "under the window", top=(0.45, 0.5), width=(0.15, 0.25), aspect=(0.3, 0.5), most=1),
         T("potted plant", "small, leafy, green", "on the windowsill", top=(0.2, 0.35), width=(0.05, 0.1)),
         T("bottle", "glass, olive-oil, green, plastic", "next to the stove", top=TABLE, width=(0.02, 0.04), aspect=(2.5, 4.0), most=4),
         T("microwave", "white, black, small", "on the shelf", top=(0.2, 0.35), width=(0.12, 0.18), aspect=(0.6, 0.8), most=1),
         T("chair", "wooden, tall, metal", "by the table", top=(0.5, 0.6), width=(0.08, 0.14), aspect=(1.5, 2.2), most=4),
         T("banana", "ripe, yellow, spotted", "in the fruit bowl", top=TABLE, width=(0.04, 0.07), aspect=(0.3, 0.5), most=3),
         T("clock", "round, wall, black-framed", "on the wall", top=WALL, width=(0.05, 0.08), most=1),
         T("cutting board", "wooden, bamboo, plastic", "on the counter", top=TABLE, width=(0.1, 0.18), aspect=(0.2, 0.4), most=1)),
        ("What meal is most likely being prepared, and what in the scene suggests it?",
         "Is there anything in this kitchen that could be a safety concern? Explain your reasoning.",
         "Why might the person have placed the objects on the counter in this arrangement?"),
    ),
    "street": SceneType(
        "street",
        ("a busy city street", "a narrow street in an old town", "a wide avenue lined with shops"),
        ("a man in a dark suit", "a woman in a long coat", "a cyclist in a yellow jacket", "a student with a backpack",
         "a delivery driver"),
        ("crossing the street", "waiting at the bus stop", "riding a bicycle", "looking at a phone", "walking a dog"),
        (T("car", "red, white, parked, black, silver", "parked along the curb", top=(0.45, 0.6), width=(0.12, 0.22), aspect=(0.4, 0.6), most=6),
         T("bus", "double-decker, blue, city", "in the right lane", top=(0.3, 0.4), width=(0.25, 0.35), aspect=(0.6, 0.8), most=1, plural="buses"),
         T("traffic light", "red, green, amber", "at the corner", top=(0.1, 0.25), width=(0.02, 0.04), aspect=(2.5, 3.5), most=3),
         T("bicycle", "blue, rusty, parked", "against a lamp post", top=(0.5, 0.65), width=(0.07, 0.12), aspect=(0.6, 0.8), most=3),
         T("stop sign", "red, faded", "on the sidewalk", top=(0.2, 0.35), width=(0.03, 0.05), most=1),
         T("bench", "wooden, green, metal", "on the sidewalk", top=(0.55, 0.65), width=(0.1, 0.16), aspect=(0.3, 0.5), most=2),
         T("fire hydrant", "yellow, red", "at the curb", top=(0.6, 0.7), width=(0.02, 0.04), aspect=(1.5, 2.0), most=1),
         T("dog", "small, brown, white, on a leash", "on the sidewalk", top=(0.6, 0.75), width=(0.04, 0.08), most=2),
         T("umbrella", "black, striped, open", "held by a pedestrian", top=(0.25, 0.4), width=(0.06, 0.1), aspect=(0.5, 0.8), most=3),
         T("truck", "white, delivery, box", "double-parked", top=(0.35, 0.45), width=(0.18, 0.26), aspect=(0.7, 0.9), most=1),
         T("handbag", "leather, red, brown", "on a shoulder", top=(0.45, 0.55), width=(0.03, 0.05), most=2)),
        ("Is it safe for the pedestrians to cross right now? Explain using what is in the scene.",
         "What time of day and what kind of weather does this scene suggest, and why?",
         "What might explain why the traffic is moving slowly here?"),
    ),
    "park": SceneType(
        "park",
        ("a city park on a sunny afternoon", "a grassy park with tall trees", "a park next to a pond"),
        ("a young girl in a red dress", "a man in running shorts", "an elderly man with a cane", "a woman with a stroller",
         "a boy in a baseball cap"),
        ("throwing a frisbee", "feeding ducks", "having a picnic", "flying a kite", "reading on a bench"),
        (T("tree", "tall, leafy, oak, bare", "in the background", top=(0.0, 0.1), width=(0.12, 0.25), aspect=(1.8, 2.6), most=5),
         T("bench", "wooden, painted, empty", "along the path", top=(0.55, 0.65), width=(0.12, 0.18), aspect=(0.3, 0.5), most=2),
         T("dog", "golden, black, fluffy, running", "on the grass", top=(0.6, 0.75), width=(0.05, 0.1), most=3),
         T("frisbee", "orange, white, flying", "in the air", top=(0.2, 0.4), width=(0.03, 0.05), aspect=(0.3, 0.5), most=1),
         T("kite", "diamond-shaped, rainbow, red", "high in the sky", top=SKY, width=(0.04, 0.08), most=2),
         T("duck", "white, brown, swimming", "on the pond", top=(0.55, 0.7), width=(0.03, 0.05), aspect=(0.6, 0.9), most=6),
         T("picnic blanket", "checkered, blue, striped", "on the grass", top=(0.65, 0.75), width=(0.15, 0.25), aspect=(0.3, 0.5), most=1),
         T("backpack", "black, purple, small", "on the blanket", top=(0.62, 0.72), width=(0.04, 0.06), most=2),
         T("bicycle", "red, child's, leaning", "against a tree", top=(0.5, 0.62), width=(0.08, 0.12), aspect=(0.6, 0.8), most=2),
         T("trash can", "green, metal", "beside the path", top=(0.55, 0.65), width=(0.04, 0.06), aspect=(1.3, 1.8), most=1),
         T("bird", "small, black, perched", "in the tree", top=(0.05, 0.3), width=(0.02, 0.03), most=3)),
        ("What season is it most likely to be, and which details support that?",
         "Could the dog interfere with any of the activities in the scene? Explain.",
         "What would be a good spot in this scene for a new person to sit, and why?"),
    ),
    "beach": SceneType(
        "beach",
        ("a sandy beach on a clear day", "a crowded beach in summer", "a quiet beach at low tide"),
        ("a surfer in a black wetsuit", "a small child in a sun hat", "a woman in a blue swimsuit", "a lifeguard in red",
         "a man in swim shorts"),
        ("walking along the shore", "swimming in the waves", "sunbathing on a towel", "playing volleyball", "carrying a surfboard"),
        (T("umbrella", "striped, blue, yellow, beach", "stuck in the sand", top=(0.35, 0.5), width=(0.1, 0.16), aspect=(0.6, 0.9), most=4),
         T("surfboard", "white, long, red", "on the sand", top=(0.4, 0.6), width=(0.03, 0.05), aspect=(3.0, 4.5), most=2),
         T("towel", "striped, pink, green", "on the sand", top=(0.7, 0.8), width=(0.1, 0.15), aspect=(0.3, 0.5), most=3),
         T("boat", "small, white, sail", "out on the water", top=(0.3, 0.38), width=(0.05, 0.1), aspect=(0.5, 0.8), most=2),
         T("seagull", "white, grey", "in the sky", top=SKY, width=(0.02, 0.04), most=4),
         T("cooler", "blue, red, plastic", "next to a towel", top=(0.65, 0.75), width=(0.05, 0.07), aspect=(0.6, 0.8), most=1),
         T("ball", "inflatable, volleyball, white", "on the sand", top=(0.6, 0.75), width=(0.02, 0.04), most=1),
         T("lifeguard tower", "wooden, red, tall", "on the beach", top=(0.2, 0.3), width=(0.08, 0.12), aspect=(1.5, 2.0), most=1),
         T("sandcastle", "small, elaborate, crumbling", "near the water", top=(0.65, 0.75), width=(0.06, 0.1), aspect=(0.5, 0.8), most=1),
         T("kite", "red, long-tailed", "above the beach", top=SKY, width=(0.03, 0.06), most=1)),
        ("Is it a good day for surfing? Explain what in the scene tells you.",
         "Why might the lifeguard tower be placed where it is?",
         "What would you pack for a visit to this beach, judging by the scene?"),
    ),
    "office": SceneType(
        "office",
        ("an open-plan office", "a small home office", "a meeting room with glass walls"),
        ("a woman in a white blouse", "a man with a headset", "a young intern", "a manager in a blue blazer"),
        ("typing on a laptop", "talking on the phone", "writing on a whiteboard", "presenting slides", "drinking coffee"),
        (T("laptop", "open, silver, black", "on the desk", top=TABLE, width=(0.08, 0.12), aspect=(0.6, 0.8), most=4),
         T("monitor", "large, widescreen, dual", "on the desk", top=(0.25, 0.35), width=(0.1, 0.16), aspect=(0.6, 0.8), most=4),
         T("keyboard", "black, wireless, mechanical", "on the desk", top=(0.5, 0.55), width=(0.08, 0.12), aspect=(0.2, 0.3), most=3),
         T("mouse", "white, wireless", "next to the keyboard", top=(0.5, 0.56), width=(0.015, 0.025), most=3, plural="mice"),
         T("chair", "swivel, black, mesh", "at the desk", top=(0.45, 0.55), width=(0.08, 0.12), aspect=(1.4, 2.0), most=5),
         T("potted plant", "tall, ficus, small", "in the corner", top=(0.3, 0.5), width=(0.06, 0.1), aspect=(1.5, 2.5), most=2),
         T("whiteboard", "large, covered in notes", "on the wall", top=WALL, width=(0.25, 0.35), aspect=(0.5, 0.7), most=1),
         T("cup", "paper, ceramic, company-logo", "on the desk", top=TABLE, width=(0.02, 0.03), most=4),
         T("book", "thick, stack of, open", "on the shelf", top=(0.15, 0.35), width=(0.02, 0.04), aspect=(1.2, 1.6), most=6),
         T("lamp", "desk, adjustable, black", "on the desk", top=(0.3, 0.4), width=(0.03, 0.05), aspect=(1.5, 2.2), most=2),
         T("phone", "cell, desk, black", "beside the laptop", top=(0.5, 0.58), width=(0.02, 0.03), most=2)),
        ("What kind of work is probably being done here, and what supports your guess?",
         "Is this workspace set up well for long hours? Give reasons from the scene.",
         "What might the notes on the whiteboard be about, given everything else in the room?"),
    ),
    "platform": SceneType(
        "platform",
        ("a train station platform", "an underground metro platform", "a small rural railway station"),
        ("a commuter in a raincoat", "a woman with a red scarf", "a conductor in uniform", "a man in a flat cap",
         "a grandmother with a walking stick"),
        ("boarding the train", "waiting on the platform", "checking the departure board", "buying a ticket", "running for the train"),
        (T("train", "red, high-speed, regional, arriving", "at the platform", top=(0.25, 0.35), width=(0.35, 0.55), aspect=(0.35, 0.5), most=1),
         T("suitcase", "black, wheeled, blue", "on the platform", top=(0.6, 0.7), width=(0.03, 0.05), aspect=(1.2, 1.6), most=4),
         T("clock", "large, station, round", "hanging from the roof", top=(0.05, 0.12), width=(0.04, 0.06), most=1),
         T("bench", "metal, long", "along the wall", top=(0.55, 0.62), width=(0.12, 0.18), aspect=(0.3, 0.4), most=2),
         T("sign", "departure, platform number, illuminated", "above the platform", top=(0.05, 0.15), width=(0.1, 0.2), aspect=(0.2, 0.35), most=3),
         T("backpack", "hiking, red, grey", "on a traveller's back", top=(0.4, 0.5), width=(0.03, 0.05), most=3),
         T("pigeon", "grey, pecking", "on the platform", top=(0.7, 0.8), width=(0.02, 0.03), most=4),
         T("ticket machine", "yellow, self-service", "by the stairs", top=(0.35, 0.45), width=(0.05, 0.08), aspect=(1.8, 2.4), most=2),
         T("umbrella", "folded, black, wet", "in a commuter's hand", top=(0.45, 0.55), width=(0.01, 0.02), aspect=(4.0, 6.0), most=2),
         T("trash can", "round, steel", "next to the bench", top=(0.55, 0.65), width=(0.03, 0.05), aspect=(1.4, 1.8), most=1)),
        ("Is the train arriving or about to leave? Explain what suggests it.",
         "Which person in the scene seems to be in the biggest hurry, and why do you think so?",
         "What should a traveller with heavy luggage watch out for here?"),
    ),
    "market": SceneType(
        "market",
        ("an outdoor farmers market", "a covered food market", "a street market on a Saturday morning"),
        ("a vendor in a straw hat", "a woman with a wicker basket", "a man with a grey beard", "a child in rain boots",
         "a young man in a denim jacket"),
        ("weighing tomatoes", "paying at a stall", "choosing bread", "arranging flowers", "chatting with a vendor"),
        (T("crate", "wooden, stacked, plastic", "under the stall", top=(0.55, 0.7), width=(0.08, 0.12), aspect=(0.5, 0.7), most=6),
         T("apple", "red, green, polished", "in a crate", top=(0.45, 0.55), width=(0.015, 0.025), most=8),
         T("awning", "striped, green and white, canvas", "over the stall", top=(0.05, 0.15), width=(0.25, 0.35), aspect=(0.2, 0.3), most=3),
         T("scale", "hanging, old, digital", "on the counter", top=(0.35, 0.45), width=(0.04, 0.06), most=2),
         T("basket", "wicker, full, empty", "on the table", top=(0.4, 0.5), width=(0.05, 0.08), aspect=(0.6, 0.9), most=4),
         T("sign", "chalkboard, hand-written, price", "propped on the table", top=(0.3, 0.42), width=(0.05, 0.08), aspect=(0.6, 1.0), most=4),
         T("bouquet", "sunflower, tulip, mixed", "in a bucket", top=(0.35, 0.5), width=(0.04, 0.07), aspect=(1.2, 1.8), most=5),
         T("loaf", "round, sourdough, long", "on a wooden board", top=(0.4, 0.5), width=(0.04, 0.07), aspect=(0.4, 0.7), most=5, plural="loaves"),
         T("dog", "small, white, curious", "under the table", top=(0.65, 0.78), width=(0.05, 0.08), most=1),
         T("bag", "paper, canvas, plastic", "in a shopper's hand", top=(0.45, 0.6), width=(0.04, 0.06), aspect=(1.0, 1.4), most=4)),
        ("Which stall seems busiest, and what makes you think so?",
         "What time of year is it likely to be, judging by the produce and flowers?",
         "If you had ten euros, what could you plausibly buy here? Reason from the scene."),
    ),
    # ---------------------------------------------------------------- calibration scene types
    "living room": SceneType(
        "living room",
        ("a cosy living room", "a sunlit living room with large windows", "a small apartment living room"),
        ("a man in a t-shirt", "a girl with braids", "a woman in a knitted sweater", "an older man in slippers"),
        ("watching television", "reading a book", "playing a board game", "petting a cat", "folding laundry"),
        (T("couch", "grey, leather, L-shaped", "against the wall", top=(0.45, 0.55), width=(0.3, 0.4), aspect=(0.35, 0.5), most=1),
         T("tv", "flat-screen, large, mounted", "on the wall", top=(0.2, 0.3), width=(0.2, 0.28), aspect=(0.5, 0.6), most=1),
         T("cat", "tabby, black, sleeping", "on the rug", top=(0.65, 0.75), width=(0.05, 0.08), aspect=(0.5, 0.8), most=2),
         T("remote", "black, small", "on the coffee table", top=(0.6, 0.65), width=(0.02, 0.03), aspect=(0.3, 0.5), most=2),
         T("book", "open, paperback, stacked", "on the shelf", top=(0.15, 0.4), width=(0.02, 0.04), aspect=(1.2, 1.6), most=6),
         T("vase", "glass, blue, with flowers", "on the windowsill", top=(0.3, 0.4), width=(0.03, 0.05), aspect=(1.5, 2.2), most=2),
         T("lamp", "floor, tall, reading", "next to the couch", top=(0.15, 0.3), width=(0.04, 0.06), aspect=(3.0, 4.0), most=2),
         T("rug", "patterned, round, woollen", "on the floor", top=(0.7, 0.78), width=(0.3, 0.4), aspect=(0.2, 0.3), most=1),
         T("cushion", "yellow, velvet, embroidered", "on the couch", top=(0.45, 0.55), width=(0.04, 0.06), most=4)),
        ("What is the family most likely doing this evening, judging by the room?",
         "Is the room arranged well for watching television? Explain."),
    ),
    "farmyard": SceneType(
        "farmyard",
        ("a farmyard in the morning", "a muddy farmyard after rain", "a small family farm"),
        ("a farmer in overalls", "a boy in rubber boots", "a woman in a checked shirt", "a vet in a green coat"),
        ("feeding the animals", "driving a tractor", "carrying hay", "milking a cow", "fixing a fence"),
        (T("cow", "black and white, brown, grazing", "in the field", top=(0.45, 0.55), width=(0.12, 0.18), aspect=(0.6, 0.8), most=4),
         T("chicken", "white, red, pecking", "in the yard", top=(0.7, 0.8), width=(0.02, 0.04), most=8),
         T("tractor", "red, green, old", "by the barn", top=(0.4, 0.5), width=(0.15, 0.22), aspect=(0.6, 0.8), most=1),
         T("barn", "red, wooden, large", "in the background", top=(0.1, 0.2), width=(0.3, 0.4), aspect=(0.6, 0.8), most=1),
         T("fence", "wooden, wire, broken", "around the field", top=(0.5, 0.6), width=(0.3, 0.5), aspect=(0.1, 0.2), most=2),
         T("bucket", "metal, plastic, full", "by the trough", top=(0.65, 0.75), width=(0.03, 0.04), most=3),
         T("horse", "chestnut, grey, saddled", "by the fence", top=(0.4, 0.5), width=(0.1, 0.14), aspect=(0.8, 1.0), most=2),
         T("sheep", "woolly, white, newly shorn", "in the pen", top=(0.55, 0.65), width=(0.05, 0.08), aspect=(0.6, 0.8), most=6, plural="sheep"),
         T("hay bale", "round, square, golden", "stacked by the barn", top=(0.5, 0.6), width=(0.06, 0.1), aspect=(0.7, 0.9), most=4)),
        ("What season is it likely to be on this farm, and why?",
         "Which animal seems to need attention first, and what suggests it?"),
    ),
    "airport gate": SceneType(
        "airport gate",
        ("an airport departure gate", "a crowded airport waiting area", "a quiet gate late at night"),
        ("a pilot in uniform", "a businesswoman with a laptop bag", "a young father", "a backpacker",
         "a gate agent"),
        ("waiting to board", "charging a phone", "sleeping across two seats", "scanning boarding passes", "eating a sandwich"),
        (T("airplane", "white, wide-body, taxiing", "outside the window", top=(0.1, 0.2), width=(0.3, 0.45), aspect=(0.3, 0.4), most=2),
         T("suitcase", "hard-shell, carry-on, purple", "next to a seat", top=(0.6, 0.7), width=(0.03, 0.05), aspect=(1.2, 1.6), most=5),
         T("seat", "row of, blue, padded", "facing the window", top=(0.5, 0.6), width=(0.05, 0.07), aspect=(1.0, 1.4), most=8),
         T("screen", "departure, flight-information", "above the gate desk", top=(0.05, 0.15), width=(0.08, 0.12), aspect=(0.5, 0.7), most=2),
         T("backpack", "green, hiking, overstuffed", "on the floor", top=(0.65, 0.75), width=(0.04, 0.06), most=3),
         T("coffee cup", "paper, half-empty", "on the floor by a seat", top=(0.7, 0.78), width=(0.015, 0.02), aspect=(1.2, 1.5), most=3),
         T("window", "floor-to-ceiling, rain-streaked", "along the wall", top=(0.05, 0.1), width=(0.3, 0.5), aspect=(0.6, 0.8), most=1),
         T("stroller", "folded, black", "by the family", top=(0.55, 0.65), width=(0.05, 0.07), aspect=(1.2, 1.6), most=1)),
        ("Is the flight likely to board soon? Explain from the scene.",
         "What could the weather be doing outside, and how might it affect the travellers?"),
    ),
    "harbour": SceneType(
        "harbour",
        ("a fishing harbour at dawn", "a busy marina", "a small stone harbour in a village"),
        ("a fisherman in yellow oilskins", "a tourist with a camera", "a woman in a striped sweater", "a boy in a red cap"),
        ("unloading fish", "mending a net", "tying up a boat", "taking photos", "painting a hull"),
        (T("boat", "fishing, blue, wooden, moored", "in the water", top=(0.4, 0.55), width=(0.12, 0.2), aspect=(0.4, 0.7), most=6),
         T("seagull", "white, screeching", "on a post", top=(0.05, 0.3), width=(0.02, 0.03), most=5),
         T("crate", "plastic, full of fish, stacked", "on the pier", top=(0.6, 0.7), width=(0.05, 0.08), aspect=(0.5, 0.7), most=4),
         T("net", "green, tangled, drying", "hung on the railing", top=(0.45, 0.55), width=(0.1, 0.15), aspect=(0.5, 0.8), most=2),
         T("lighthouse", "white, striped, distant", "at the end of the breakwater", top=(0.05, 0.15), width=(0.03, 0.05), aspect=(2.5, 3.5), most=1),
         T("buoy", "orange, red", "floating near the boats", top=(0.55, 0.65), width=(0.015, 0.025), most=4),
         T("rope", "coiled, thick", "on the quay", top=(0.7, 0.8), width=(0.04, 0.06), aspect=(0.5, 0.7), most=3),
         T("bicycle", "old, rusty", "leaning on a wall", top=(0.5, 0.6), width=(0.07, 0.1), aspect=(0.6, 0.8), most=1)),
        ("Have the boats just come back or are they about to go out? Explain.",
         "What is the most likely way this village earns its living, and what in the scene shows it?"),
    ),
    "classroom": SceneType(
        "classroom",
        ("a primary school classroom", "a university lecture room", "a bright art classroom"),
        ("a teacher in a cardigan", "a student with a ponytail", "a boy with curly hair", "a teaching assistant"),
        ("writing on the blackboard", "reading aloud", "working in small groups", "painting", "taking a test"),
        (T("desk", "wooden, small, cluttered", "in rows", top=(0.5, 0.6), width=(0.08, 0.12), aspect=(0.5, 0.7), most=8),
         T("chair", "plastic, blue, stacked", "at a desk", top=(0.55, 0.65), width=(0.04, 0.06), aspect=(1.3, 1.8), most=8),
         T("blackboard", "large, green, chalk-covered", "on the front wall", top=WALL, width=(0.3, 0.45), aspect=(0.4, 0.5), most=1),
         T("globe", "old, spinning", "on the teacher's desk", top=(0.35, 0.45), width=(0.03, 0.05), most=1),
         T("backpack", "colourful, small, unzipped", "under a desk", top=(0.65, 0.75), width=(0.03, 0.05), most=6),
         T("poster", "alphabet, world map, periodic table", "on the side wall", top=(0.1, 0.25), width=(0.08, 0.14), aspect=(1.2, 1.5), most=3),
         T("clock", "round, white", "above the door", top=(0.02, 0.1), width=(0.03, 0.05), most=1),
         T("book", "open, exercise, textbook", "on a desk", top=(0.5, 0.56), width=(0.03, 0.05), aspect=(0.6, 0.9), most=8)),
        ("What subject is probably being taught right now, and why do you think so?",
         "How old are the students likely to be? Reason from the objects in the room."),
    ),
}

SPLIT_SCENES = {
    EVALUATION: ("kitchen", "street", "park", "beach", "office", "platform", "market"),
    CALIBRATION: ("living room", "farmyard", "airport gate", "harbour", "classroom"),
}
ROWS = {EVALUATION: 13, CALIBRATION: 10}
TASKS = ("detailed", "positions", "count", "conversation", "reasoning")

DETAILED = (
    "Describe the image in detail.",
    "Give a thorough description of everything you can see in this picture, including where things are.",
    "What is happening in this image? Describe the scene, the people and the objects, and how they are laid out.",
    "Write a detailed paragraph describing this photo for someone who cannot see it.",
)


@dataclass(frozen=True)
class Placed:
    thing: Thing
    attr: str
    box: tuple[float, float, float, float]

    @property
    def centre(self) -> tuple[float, float]:
        return ((self.box[0] + self.box[2]) / 2, (self.box[1] + self.box[3]) / 2)


def _box(rng: random.Random, thing: Thing) -> tuple[float, float, float, float]:
    w = rng.uniform(*thing.width)
    h = min(0.95, w * rng.uniform(*thing.aspect))
    x1 = rng.uniform(0.0, 1.0 - w)
    y1 = min(rng.uniform(*thing.top), 1.0 - h)
    return tuple(round(v, 3) for v in (x1, y1, x1 + w, y1 + h))  # type: ignore[return-value]


def _place(rng: random.Random, scene: SceneType) -> tuple[list[Placed], list[tuple[str, str, tuple]]]:
    """People first (the captions' subjects), then objects in a random order of salience."""
    people = []
    for who in rng.sample(scene.people, rng.randint(1, min(3, len(scene.people)))):
        w = rng.uniform(0.08, 0.16)
        h = min(0.9, w * rng.uniform(2.2, 3.2))
        x1, y1 = rng.uniform(0.0, 1.0 - w), rng.uniform(0.15, 0.95 - h)
        people.append((who, rng.choice(scene.activities), tuple(round(v, 3) for v in (x1, y1, x1 + w, y1 + h))))
    placed = []
    things = list(scene.things)
    rng.shuffle(things)
    for thing in things:
        for _ in range(rng.randint(1, thing.most)):
            placed.append(Placed(thing, rng.choice(thing.attrs), _box(rng, thing)))
    rng.shuffle(placed)
    return placed, people


def _fmt(box: tuple) -> str:
    return "[" + ", ".join(f"{v:.3f}" for v in box) + "]"


def _a(phrase: str) -> str:
    return ("an " if phrase[0] in "aeiou" else "a ") + phrase


def _count_phrase(n: int, thing: Thing) -> str:
    return f"{NUMBERS[n] if n < len(NUMBERS) else n} {thing.name if n == 1 else thing.many}"


def _captions(rng: random.Random, scene: SceneType, setting: str, placed: list[Placed], people: list) -> list[str]:
    counts: dict[str, tuple[Thing, int]] = {}
    for p in placed:
        counts[p.thing.name] = (p.thing, counts.get(p.thing.name, (p.thing, 0))[1] + 1)
    names = list(counts)
    who, doing, _ = people[0]
    a, b, c = (counts[names[i % len(names)]] for i in range(3))
    left = min(placed[:6], key=lambda p: p.centre[0])
    right = max(placed[:6], key=lambda p: p.centre[0])
    options = [
        f"{who[0].upper()}{who[1:]} {doing} in {setting}.",
        f"{setting[0].upper()}{setting[1:]} with {_count_phrase(a[1], a[0])}, {_count_phrase(b[1], b[0])} and {_a(c[0].name)}.",
        f"{_a(left.attr + ' ' + left.thing.name).capitalize()} on the left and {_a(right.thing.name)} on the right of {setting}.",
        f"someone {doing} while {_a(b[0].name)} sits {b[0].place}",
        f"A photo of {setting} in {rng.choice(scene.light)}.",
        f"{who.capitalize()} is {doing} near {_a(a[0].name)}.",
        f"There {'are ' + _count_phrase(a[1], a[0]) if a[1] > 1 else 'is ' + _a(a[0].name)} {a[0].place} and {_a(c[0].name)} {c[0].place}.",
    ]
    if len(people) > 1:
        options.append(f"{NUMBERS[len(people)].capitalize()} people in {setting}, one of them {doing}.")
    rng.shuffle(options)
    return options[:5]


def _region(p: Placed) -> str:
    return f"{_a(p.attr + ' ' + p.thing.name)} {p.thing.place}: {_fmt(p.box)}"


def _instruction(task: str, rng: random.Random, scene: SceneType, setting: str, placed: list[Placed], people: list) -> str:
    if task == "detailed":
        return rng.choice(DETAILED)
    if task == "positions":
        x, y = rng.sample(placed[:8], 2)
        return rng.choice((
            f"Where is the {x.thing.name} relative to the {y.thing.name}? Use the boxes to explain left/right and above/below.",
            f"Which is closer to the top of the image, the {x.thing.name} or the {y.thing.name}? And what is in the bottom-right corner?",
            f"If you drew a line from the {x.thing.name} to the {y.thing.name}, which objects would it pass near?",
        ))
    if task == "count":
        many = [p.thing for p in placed if sum(q.thing is p.thing for q in placed) > 1] or [placed[0].thing]
        thing = rng.choice(many)
        return f"How many {thing.many} are in the picture, and where is each one? Then say which part of the image is the most crowded."
    if task == "conversation":
        who, doing, _ = people[0]
        first = placed[0]
        return (
            "This is part of a conversation about the image. Continue it with the assistant's next answer.\n\n"
            f"User: What kind of place is this?\nAssistant: It looks like {setting}; {who} is {doing}.\n"
            f"User: Is there {_a(first.thing.name)} in the picture?\nAssistant: Yes, there is {_a(first.attr + ' ' + first.thing.name)} "
            f"{first.thing.place}.\nUser: {rng.choice(('What else is near it?', 'What is the person about to do next?', 'Describe the area on the right side of the image.'))}"
        )
    return rng.choice(scene.reasoning)


def _row(name: str, task: str, window: Window, rng: random.Random, count: Count) -> Row:
    scene = SCENES[name]
    setting = rng.choice(scene.settings)
    placed, people = _place(rng, scene)
    target = rng.randint(window.low + 100, window.high)
    words = random.Random(rng.random())

    def build(n: int) -> str:
        # Captions and the question only speak of the objects listed, so they are drawn per length
        # (with the same random draws each time).
        shown = placed[:n]
        draws = same_draws(words)
        captions = _captions(draws, scene, setting, shown, people)
        instruction = _instruction(task, draws, scene, setting, shown, people)
        objects = [f"person: {_fmt(box)}" for _, _, box in people] + [f"{p.thing.name}: {_fmt(p.box)}" for p in shown]
        regional = [f"{who} {doing}: {_fmt(box)}" for who, doing, box in people]
        regional += [_region(p) for p in shown[: max(2, n // 3)]]
        return (
            "You are looking at an image. Instead of the pixels you are given what annotators wrote about it: five "
            "captions, the objects with their bounding boxes, and descriptions of some regions. Boxes are "
            "[x1, y1, x2, y2], normalised to 0..1, with x growing to the right and y growing downwards. Answer as "
            "if you were looking at the picture, and do not mention the captions or the coordinates.\n\n"
            "Captions:\n" + "\n".join(f"- {c}" for c in captions) + "\n\n"
            "Objects:\n" + "\n".join(objects) + "\n\n"
            "Regions:\n" + "\n".join(regional) + f"\n\n{instruction}"
        )

    prompt, _ = longest_fit(build, len(placed), target, count, least=min(3, len(placed)))
    return Row(prompt, KIND, task, (f"kvtool scene generator: {name}",))



def rows(split: str, count: Count) -> list[Row]:
    names = SPLIT_SCENES[split]
    out = []
    for i in range(ROWS[split]):
        rng = random.Random(f"{split}:{KIND}:{i}")
        out.append(_row(names[i % len(names)], TASKS[i % len(TASKS)], WINDOWS[split], rng, count))
    return out
