"""The Tofino slot state machine's decisions (p4/tofino/slot_update.p4) against the switch contract.

The slot pass's chain (slot_prep, then five register tables, each keyed on the answers of the registers
before it, plus result_prep and decide); their const entries are the whole decision logic. This test
reads those entries from the source, walks them for every combination of a slot's state and a packet
(the register actions' answers modelled as their P4 bodies say: slot_seq and slot_count answer a
stateful-ALU predicate, 1 << (cmplo + 2 * cmphi); slot_round answers its XOR with the packet's word) and
compares the branch, the element operation, what is emitted, result_quorum and what slot_result is given
with the contract of docs/protocol.md written out here (as the v1model program and the Tofino section
say)."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TOFINO = ROOT / "p4" / "tofino"
SOURCE = re.sub(r"//[^\n]*", "", (TOFINO / "slot_update.p4").read_text())


def constants() -> dict[str, int]:
    text = "".join((TOFINO / n).read_text() for n in ("protocol_constants.gen.p4", "headers.p4")) + SOURCE
    return {
        name: int(value, 0)
        for name, value in re.findall(r"const\s+bit<\d+>\s+(\w+)\s*=\s*(0x[0-9a-fA-F]+|\d+)\s*;", text)
    }


C = constants()
OTHERS = 0x00F0_0000  # the bits of workers 20..23 (the tests' senders are 0, 5 and 31)
# The low word of the packet's own bitmap field, which the slot pass reuses for slot_bitmap's answer and
# slot_result's bitmap input: whatever a worker put there (every bit set, the sender's included) must
# not leak into a decision or into slot_result.
PACKET_WORD = 0xFFFF_FFFF


def number(token: str) -> int:
    token = token.strip()
    if token in ("false", "true"):
        return int(token == "true")
    if token in C:
        return C[token]
    return int(re.sub(r"^\d+w", "", token), 0)


def entries(table: str) -> list[tuple[list[tuple[int, int] | None], str, list[int]]]:
    """(keys as (value, mask) or None for _, action, action arguments) of a const-entries table."""
    body = re.search(rf"table\s+{table}\s*\{{.*?const entries = \{{(.*?)\n        \}}", SOURCE, re.S)
    assert body, table
    out = []
    for raw in body.group(1).split(";"):
        raw = " ".join(raw.split())
        if not raw:
            continue
        keys, action = raw.rsplit(":", 1) if raw.startswith("(") else raw.split(":", 1)
        keys = keys.strip().removeprefix("(").removesuffix(")")
        parsed: list[tuple[int, int] | None] = []
        for key in keys.split(","):
            key = key.strip()
            if key == "_":
                parsed.append(None)
            elif "&&&" in key:
                value, mask = key.split("&&&")
                parsed.append((number(value), number(mask)))
            else:
                parsed.append((number(key), -1))
        name, args = re.match(r"\s*(\w+)\((.*)\)\s*$", action).groups()
        out.append((parsed, name, [number(a) for a in args.split(",") if a.strip()]))
    return out


def first(table: str, *values: int) -> tuple[str, list[int]] | None:
    for keys, action, args in entries(table):
        assert len(keys) == len(values), table
        if all(k is None or (v & k[1]) == (k[0] & k[1]) for k, v in zip(keys, values, strict=True)):
            return action, args
    return None


def walk(op: str, order: str, flushed: bool, differs: str, seen: bool, count_room: int, closed: bool,
         quorum: int, packet_max: bool, worker: int = 5) -> dict:  # fmt: skip
    """The control pass of one packet through the tables. count_room: quorum - count before it
    (<= 0: the quorum was reached); differs: what the stored round has other than the packet ("": the
    same exponent and MAX flag, "exp", "max"); closed: slot_result closed, and slot_round marked CLOSED
    by the element pass of the round's RESULT (test_the_element_pass_of_a_result_marks_the_round)."""
    bit = 1 << worker
    stored_bitmap = (bit if seen else 0) | OTHERS
    exp = 7
    # slot_prep (the slot pass): the mode and the round word's bits above the exponent
    flags = (C["FLAG_MAX"] if packet_max else 0) | C["FLAG_CRITICAL"]
    prep, prep_args = first("slot_prep", 1, C["PASS_SLOT"], C["EMIT_NONE"], C[f"OP_{op}"], flags)
    mode = {"prep_grad": C["MODE_GRAD"], "prep_flush": C["MODE_FLUSH"]}[prep]
    packet_round = prep_args[0] << 8 | exp
    stored_round = (
        (exp + 1 if differs == "exp" else exp)
        | (C["ROUND_MAX"] if packet_max != (differs == "max") else 0)
        | (C["ROUND_FLUSHED"] if flushed else 0)
        | (C["ROUND_CLOSED"] if closed else 0)
    )
    # slot_seq: this.predicate(q > seq, q == seq)
    seq_code = {"older": 1, "newer": 2, "same": 4}[order]
    round_access = first("round_access_table", mode, seq_code)
    round_answer = 0
    if round_access and round_access[0] in ("do_round_compare", "do_round_flush"):
        round_answer = stored_round ^ packet_round
    action, args = first("bitmap_access_table", mode, seq_code, round_answer)
    codes = {
        "do_bitmap_set": C["BITMAP_SET"],
        "do_bitmap_clear": C["BITMAP_CLEAR"],
        "do_bitmap_test_set": C["BITMAP_TEST_SET"],
    }
    bitmap_code = codes.get(action, args[0] if args else 0)
    old_bitmap = {"do_bitmap_set": bit, "do_bitmap_clear": 0}.get(action, stored_bitmap)
    if action == "no_bitmap":
        old_bitmap = PACKET_WORD  # no register answer: the word still holds the packet's bits
    count = first("count_access_table", mode, bitmap_code, old_bitmap, worker)
    count_code = 0
    q = 0 if prep == "prep_flush" else quorum  # prep_flush zeroes a FLUSH's quorum (and weight)
    lo = q - count_room
    if count and count[0] == "do_count_add":
        count_code = 1 << (int(lo < q) + 2 * int(lo + 1 == q))
    elif count and count[0] == "do_count_probe":  # this.predicate(count < quorum); the code rewritten
        count_code, bitmap_code = 1 << int(lo < q), C["BITMAP_DUP"]
    prep = first("result_prep", mode, bitmap_code, count_code, int(quorum <= 1))
    sat, closed_flags = 2, C["RESULT_CLOSED"] | worker << 8
    res = {
        "prep_start": (C["RESULT_SET"], 0, sat),
        "prep_start_closed": (C["RESULT_SET"], bit, sat | closed_flags),
        "prep_flush_empty": (C["RESULT_SET"], 0, closed_flags),
        "prep_close": (C["RESULT_OR_CLOSE"], old_bitmap, closed_flags),
        "prep_add_close": (C["RESULT_OR_CLOSE"], old_bitmap | bit, sat | closed_flags),
        "prep_add": (C["RESULT_OR_CLOSE"], None, sat),
    }
    result_code, res_bitmap, res_flags = (0, None, None)
    if prep:
        result_code, res_bitmap, res_flags = res.get(prep[0], (prep[1][0] if prep[1] else 0, None, None))
    result_hi = (
        C["RESULT_CLOSED"] if closed and result_code in (C["RESULT_OR_CLOSE"], C["RESULT_READ_HI"]) else 0
    )
    decided = first("decide", mode, bitmap_code, count_code, result_hi, int(quorum <= 1), packet_round)
    out = {"branch": None, "element_op": None, "emit": None, "quorum": False, "result": None}
    if result_code == C["RESULT_SET"]:
        out["result"] = ("set", res_bitmap, res_flags)
    elif result_code == C["RESULT_OR_CLOSE"] and not closed:
        out["result"] = (
            ("close", res_bitmap, res_flags) if res_flags & C["RESULT_CLOSED"] else ("or", res_flags)
        )
    if decided:
        name, args = decided
        out["branch"] = args[0]
        if name == "finish_pass":
            out["element_op"], out["emit"] = args[1], args[2]
        elif name == "finish_quorum":
            out["element_op"], out["emit"], out["quorum"] = args[1], C["EMIT_MULTICAST"], True
    return out


def contract(op, order, flushed, differs, seen, count_room, closed, quorum, packet_max, worker=5) -> dict:
    """What the switch contract says the control pass does with this packet and slot."""
    B = {n: C[f"BRANCH_{n}"] for n in ("GRAD_STALE", "FLUSH_STALE", "GRAD_START", "FLUSH_EMPTY",
                                       "FLUSH_RESEND", "FLUSH_PARTIAL", "GRAD_LATE_RESEND", "GRAD_DUP",
                                       "GRAD_EXP_MISMATCH", "GRAD_ADD")}  # fmt: skip
    load, mc, resend = C["ELEMENT_OP_LOAD"], C["EMIT_MULTICAST"], C["EMIT_RESEND"]
    bit, sat, closed_flags = 1 << worker, 2, C["RESULT_CLOSED"] | worker << 8
    bitmap = (bit if seen else 0) | OTHERS

    def out(branch, element_op=None, emit=None, quorum=False, result=None):
        return {"branch": branch, "element_op": element_op, "emit": emit, "quorum": quorum, "result": result}

    if order == "older":
        return out(B["GRAD_STALE"] if op == "GRAD" else B["FLUSH_STALE"])
    if order == "newer":
        if op == "FLUSH":
            return out(B["FLUSH_EMPTY"], C["ELEMENT_OP_CLEAR"], mc, result=("set", 0, closed_flags))
        if quorum <= 1:
            return out(B["GRAD_START"], C["ELEMENT_OP_STORE"], mc, True, ("set", bit, sat | closed_flags))
        return out(B["GRAD_START"], C["ELEMENT_OP_STORE"], C["EMIT_NONE"], result=("set", 0, sat))
    if op == "FLUSH":
        if flushed or closed:
            return out(B["FLUSH_RESEND"], load, resend)
        return out(B["FLUSH_PARTIAL"], load, mc, result=("close", bitmap, closed_flags))
    if flushed or closed:
        # late, whatever the count: also below a quorum raised after the closure (count_room > 0)
        return out(B["GRAD_LATE_RESEND"], load, resend)
    if not differs and not seen:
        add = C["ELEMENT_OP_MAX"] if packet_max else C["ELEMENT_OP_ADD"]
        if count_room > 1:
            return out(B["GRAD_ADD"], add, C["EMIT_NONE"], result=("or", sat))
        if count_room == 1:
            return out(B["GRAD_ADD"], add, mc, True, ("close", bitmap | bit, sat | closed_flags))
        # the quorum was lowered under an open round: closed without this packet (Tofino section)
        return out(B["GRAD_LATE_RESEND"], load, mc, True, ("close", bitmap, closed_flags))
    if seen and count_room <= 0:
        # a duplicate at the quorum (lowered under the open round): closed as a quorum close, with the
        # round's bitmap and this sender as its closer, nothing of the packet added
        return out(B["GRAD_DUP"], load, mc, True, ("close", bitmap, closed_flags))
    return out(B["GRAD_DUP"] if seen else B["GRAD_EXP_MISMATCH"])


CASES = list(
    itertools.product(
        ("GRAD", "FLUSH"), ("older", "newer", "same"), (False, True), ("", "exp", "max"), (False, True),
        (-1, 0, 1, 2, 5), (False, True), (1, 3), (False, True),
    )
)  # fmt: skip


def test_slot_prep_gives_each_pass_its_mode_and_round_word():
    """slot_prep's entries: a GRAD or FLUSH in the slot pass gets its op's mode and the round word
    exp | MAX << 8 | FLUSHED << 9 (the contract's round identity: exponent, MAX, flushed); the element
    pass of a packet that leaves as a RESULT reads the stored fields (MODE_EMIT), the harvest pass
    MODE_HARVEST; the control pass and every other packet touch no slot register (MODE_NONE)."""
    slot, elements, harvest = C["PASS_SLOT"], C["PASS_ELEMENTS"], C["PASS_HARVEST"]
    for op in ("GRAD", "FLUSH"):
        for flags in range(256):
            action, args = first("slot_prep", 1, slot, C["EMIT_NONE"], C[f"OP_{op}"], flags)
            assert action == {"GRAD": "prep_grad", "FLUSH": "prep_flush"}[op]
            word = args[0] << 8 | 0x5A
            assert word & 0xFF == 0x5A
            assert bool(word & C["ROUND_MAX"]) == bool(flags & C["FLAG_MAX"])
            assert bool(word & C["ROUND_FLUSHED"]) == (op == "FLUSH")
            assert word >> 10 == 0
    flush_zeroes = r"action prep_flush\(bit<24> round_hi\) \{[^}]*meta\.quorum = 0;[^}]*hdr\.lta\.weight = 0;"
    assert re.search(flush_zeroes, SOURCE)
    for op in ("HEARTBEAT", "PARAM", "PARAM_REQ", "RESULT"):
        assert first("slot_prep", 1, slot, C["EMIT_NONE"], C[f"OP_{op}"], 0) is None
    assert first("slot_prep", 1, elements, C["EMIT_NONE"], 0, 0) == ("prep_pass", [C["MODE_NONE"]])
    for emit in (C["EMIT_MULTICAST"], C["EMIT_RESEND"]):
        assert first("slot_prep", 1, elements, emit, 0, 0) == ("prep_pass", [C["MODE_EMIT"]])
        assert first("slot_prep", 1, harvest, emit, 0, 0) == ("prep_harvest", [])
    harvest_prep = re.search(r"action prep_harvest\(\) \{([^}]*)\}", SOURCE).group(1)
    assert "meta.slot_mode = MODE_HARVEST;" in harvest_prep
    assert "meta.quorum = QUORUM_HARVEST;" in harvest_prep
    assert first("slot_prep", 0, C["PASS_CONTROL"], 0, C["OP_GRAD"], 0) is None  # default: prep_none
    assert re.search(r"const default_action = prep_none\(\);", SOURCE)


@pytest.mark.parametrize("worker", [0, 5, 31])
def test_slot_tables_decide_as_the_contract_says(worker):
    for case in CASES:
        op, order, flushed, differs, seen, count_room, closed, quorum, packet_max = case
        if order == "newer" and (flushed or differs or seen or closed or count_room != 2):
            continue  # a new round: nothing of the old one is read
        if order == "same" and count_room == 2 and quorum == 1:
            continue  # count = quorum - 2 < 0
        got = walk(*case, worker=worker)
        assert got == contract(*case, worker=worker), case


def test_predicate_codes_are_one_hot_of_cmplo_and_cmphi():
    """this.predicate(cmplo, cmphi) is the 4-bit one-hot of cmplo + 2 * cmphi (p4c's Tofino backend:
    cmplo covers predicate bits 0xa, cmphi 0xc); the tables key on these values."""
    assert (C["SEQ_OLDER"], C["SEQ_NEWER"], C["SEQ_SAME"]) == (1 << 0, 1 << 1, 1 << 2)
    assert (C["COUNT_NOT_ADDED"], C["COUNT_ADDED"], C["COUNT_CLOSING"]) == (1 << 0, 1 << 1, 1 << 3)
    assert (C["COUNT_MET"], C["COUNT_BELOW"]) == (1 << 0, 1 << 1)
    assert re.search(r"this\.predicate\(hdr\.lta\.seq > value, hdr\.lta\.seq == value\)", SOURCE)
    assert re.search(r"this\.predicate\(value\.lo < meta\.quorum, value\.lo \+ 1 == meta\.quorum\)", SOURCE)
    # the duplicate's probe answers codes an add also answers: its own bitmap code tells them apart
    assert re.search(r"count_probe = \{\s*void apply\(inout slot_pair_t value, out bit<8> rv\) \{\s*"
                     r"rv = this\.predicate\(value\.lo < meta\.quorum\);\s*\}", SOURCE)  # fmt: skip
    bitmap_codes = [v for k, v in C.items() if k.startswith("BITMAP_")]
    assert len(set(bitmap_codes)) == len(bitmap_codes) and 0 not in bitmap_codes
    assert re.search(r"action do_count_probe\(\) \{[^}]*bitmap_code = BITMAP_DUP;", SOURCE)


def test_slot_count_start_and_harvest_share_one_register_action():
    """slot_count has four register actions (Tofino 1's limit): the start's write and the harvest's read
    of the weight are one, which writes only when the quorum is not QUORUM_HARVEST (the harvest pass's,
    set by slot_prep; a job's quorum is 8 bits, so none has it) and answers the weight read before it."""
    assert C["QUORUM_HARVEST"] > 0xFF
    body = re.search(r"count_set_or_weight = \{\s*void apply\(inout slot_pair_t value, out bit<32> rv\) "
                     r"\{(.*?)\n        \}\n    \};", SOURCE, re.S).group(1)  # fmt: skip
    body = " ".join(body.split())
    assert body.startswith("rv = value.hi; if (meta.quorum != QUORUM_HARVEST) {"), body
    assert body.endswith("value.hi = hdr.lta.weight; }"), body
    read_hi = r"action do_count_read_hi\(\) \{ hdr\.lta\.weight = count_set_or_weight\.execute"
    assert re.search(read_hi, SOURCE)
    assert first("count_access_table", C["MODE_HARVEST"], 0, 0, 0) == ("do_count_read_hi", [])


def test_a_packet_the_up_loss_policy_drops_touches_no_slot_register():
    """The chain starts on the policy's decision: slot_seq's table executes only for a kept packet, and
    every later table needs slot_seq's answer (a dropped packet leaves seq 0: no entry takes it)."""
    for mode in (C["MODE_GRAD"], C["MODE_FLUSH"]):
        assert first("seq_access_table", mode, 0) == ("do_seq_order", [])
        assert first("seq_access_table", mode, 1) is None
        assert first("round_access_table", mode, 0) is None
        assert first("bitmap_access_table", mode, 0, 0) is None


def register_actions(register: str) -> dict[str, str]:
    """name -> body (whitespace collapsed) of each RegisterAction on ``register``."""
    found = re.findall(
        rf"RegisterAction<[^(]*>\({register}\)\s+(\w+)\s*=\s*\{{\s*void apply\([^)]*\)\s*\{{(.*?)\}}\s*\}};",
        SOURCE,
        re.S,
    )
    return {name: " ".join(body.split()) for name, body in found}


def test_the_element_pass_of_a_result_marks_the_round():
    """Every RESULT leaves through an element pass with MODE_EMIT (slot_prep), which asks slot_seq
    whether the slot still holds the packet's round and, if so, reads slot_round and marks it CLOSED;
    a slot that has moved on to a newer round is only read (the packet's word is 0 there, so the XOR is
    the stored word). A closure always sends a RESULT (test_slot_tables_decide_as_the_contract_says),
    so each is marked; slot_round keeps Tofino 1's four register actions, and a new round's word (set
    from the packet's) never carries the mark."""
    mode = C["MODE_EMIT"]
    assert first("seq_access_table", mode, 0) == ("do_seq_order", [])
    assert first("round_access_table", mode, C["SEQ_SAME"]) == ("do_round_close", [])
    assert first("round_access_table", mode, C["SEQ_OLDER"]) == ("do_round_compare", [])
    assert first("round_access_table", mode, C["SEQ_NEWER"]) is None  # the slot pass stored q already
    actions = register_actions("slot_round")
    assert len(actions) <= 4, sorted(actions)
    assert actions["round_close"] == "rv = value; value = value | ROUND_CLOSED;"
    assert actions["round_compare"] == "rv = value ^ meta.packet_round;"
    assert actions["round_set"] == "value = meta.packet_round; rv = 0;"
    assert re.search(r"action prep_pass\(bit<8> mode\) \{[^}]*meta\.packet_round = 0;", SOURCE)
    assert C["ROUND_CLOSED"] & 0x3FF == 0 and C["ROUND_CLOSED"] & C["ROUND_CLOSED"] - 1 == 0
    # a RESULT's element pass (any emit but NONE) has MODE_EMIT
    for emit in (C["EMIT_MULTICAST"], C["EMIT_RESEND"]):
        assert first("slot_prep", 1, C["PASS_ELEMENTS"], emit, 0, 0) == ("prep_pass", [mode])


def test_a_late_grad_before_the_mark_is_late_unless_the_quorum_was_raised_in_that_window():
    """In the one recirculation between a closing slot pass and its element pass slot_round is not yet
    marked (bitmap code TEST_SET, DUP or EXP_OTHER, not LATE_CLOSED): decide then tells a late GRAD from
    slot_result's CLOSED bit, as before the mark, except an add slot_count made, which only a quorum
    raised inside that window allows (the residual, docs/protocol.md, "Tofino", "Raised quorum")."""
    grad, closed = C["MODE_GRAD"], C["RESULT_CLOSED"]
    late = ("finish_pass", [C["BRANCH_GRAD_LATE_RESEND"], C["ELEMENT_OP_LOAD"], C["EMIT_RESEND"]])
    for quorum_of_one in (0, 1):
        assert (
            first("decide", grad, C["BITMAP_TEST_SET"], C["COUNT_NOT_ADDED"], closed, quorum_of_one, 7)
            == late
        )
        for code in (C["COUNT_MET"], C["COUNT_BELOW"]):
            assert first("decide", grad, C["BITMAP_DUP"], code, closed, quorum_of_one, 7) == late
        assert first("decide", grad, C["BITMAP_EXP_OTHER"], 0, closed, quorum_of_one, 7) == late
        for code in (C["COUNT_ADDED"], C["COUNT_CLOSING"]):
            action, args = first("decide", grad, C["BITMAP_TEST_SET"], code, closed, quorum_of_one, 7)
            assert args[0] == C["BRANCH_GRAD_ADD"]  # the residual: added
