"""Built-in word lists: the vocabulary of the bundled model's synthetic tasks.

Used for RULER keys (``adjective-noun``), the common-words task, and the built-in prose that
stands in for Paul Graham's essays when no essay file is given. All lowercase, unique across
lists, and free of the words the task templates use as markers ("special", "magic", "pass",
"key", "variable"), so filler never looks like a needle.
"""

from __future__ import annotations

ADJECTIVES: tuple[str, ...] = tuple("""
able active angry bitter black blue bold brave bright broad broken busy calm careful cheap
clean clear clever close cold cool crisp curious dark deep dry dull eager early easy empty
fair famous fancy fast fierce fine firm flat fresh friendly full funny gentle giant glad
golden good grand gray great green happy hard heavy helpful high hollow honest hot huge
humble hungry kind large late lazy light little lively lonely long loud lovely low lucky
mild modern narrow neat new nice noble odd old orange pale plain polite poor proud purple
quick quiet rapid rare raw real red rich rough round royal rude sad safe sharp shiny short
shy silent silver simple slow small smooth soft solid sour spare steady steep sticky strange
strong sunny sweet swift tall tame thick thin tidy tiny tough true ugly vast warm weak wet
white wide wild wise witty yellow young
""".split())

NOUNS: tuple[str, ...] = tuple("""
anchor animal apple arrow autumn badge bag ball banana band bank barn basket bath beach bean
bear bed bell belt bench berry bird blanket boat bone book boot bottle bowl box branch bread
bridge brick brush bucket butter button cabin cake camera camp candle canoe car card carpet
castle cat cave chain chair chalk cheese cherry chest chicken church circle city cliff clock
cloud coat coffee coin comet corn cotton cow crab crown cup curtain desk diamond dinner dog
doll door dragon drawer dream drum duck eagle egg engine farm feather fence field finger
fish flag flame flower flute fog forest fork fountain fox frog garden gate ghost gift glass
glove goat grape grass guitar hammer harbor hat hawk heart helmet hill honey horse house
island jacket jar jewel kettle king kitchen kite ladder lake lamp leaf lemon letter library
lion lizard lock map market meadow mirror monkey moon mountain mouse mug nail napkin nest
net ocean orchard owl oyster paint palace pan paper parrot path peach pear pencil piano
pillow pipe planet plate pocket pond potato puppet queen rabbit radio rain ribbon ring river
road robot rock roof rope rose sail salt sand scarf school sea seed sheep shell ship shoe
shop silk sky snake snow sock spoon star stone storm street sugar table tail tea tent
thread ticket tiger tower town toy train tree trumpet tunnel turtle umbrella valley vase
village violin wagon wall whale wheel window wind wolf wood world yard zebra
""".split())

VERBS: tuple[str, ...] = tuple("""
admire borrow bring build buy carry catch chase carve climb collect cook count cover cut
dance draw drink drive drop eat explore fill find fix fold follow gather give grab grow help
hide hold hug jump kick kiss knock lift listen love mend move open wipe pick plant play pour
protect pull push reach read repair ride roll rub search sell send sew share shake sing sit
sleep smell splash spin stack steal sweep swim take taste teach throw touch trade visit wash
watch wave wrap write
""".split())

# Closed-class words used only by the prose generator.
DETERMINERS: tuple[str, ...] = ("the", "this", "that", "every", "my", "our", "your", "their")
PREPOSITIONS: tuple[str, ...] = ("near", "under", "behind", "beside", "above", "inside", "across", "around")
ADVERBS: tuple[str, ...] = ("often", "rarely", "always", "never", "slowly", "quickly", "gladly", "soon")
PRONOUNS: tuple[str, ...] = ("we", "they", "i", "you")
NAMES: tuple[str, ...] = (
    "Anna", "Ben", "Clara", "David", "Ella", "Felix", "Grace", "Henry", "Iris", "Jack",
    "Kate", "Leo", "Maya", "Noah", "Olga", "Paul", "Rosa", "Sam", "Tina", "Victor",
)

# The noise haystack sentence of RULER (niah_single_1, vt), verbatim.
NOISE_SENTENCE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."


def all_content_words() -> tuple[str, ...]:
    """Adjectives, nouns and verbs, de-duplicated and sorted (the common-words vocabulary)."""
    return tuple(sorted(set(ADJECTIVES) | set(NOUNS) | set(VERBS)))
