"""Our grammar sampler against libllama's llama_sampler_init_grammar(_lazy_patterns), token for token.

libllama runs in a child process (ctypes, SmolLM2's vocabulary loaded vocab-only). For each grammar it
applies the grammar sampler to the whole vocabulary, records which tokens stay finite, then accepts a
token: the next one of a given text, else the highest of seeded random logits among the finite ones.
We replay the same path and must leave exactly the same tokens finite at every step, and allows() must
agree with that set. Lazy grammars are checked the same way, through their trigger.
"""

from __future__ import annotations

import ctypes
import re
from pathlib import Path

import gguf
import numpy as np
import pytest

from orchestrator.sampling.gbnf import GrammarError
from orchestrator.sampling.grammar import GrammarSampler
from orchestrator.tokenizer import Vocab

from . import libllama_child

ORACLE_TIMEOUT = 600

JSON = r'''
root   ::= object
value  ::= object | array | string | number | ("true" | "false" | "null") ws
object ::= "{" ws ( string ":" ws value ("," ws string ":" ws value)* )? "}" ws
array  ::= "[" ws ( value ("," ws value)* )? "]" ws
string ::= "\"" ( [^"\\\x7F\x00-\x1F] | "\\" (["\\bfnrt] | "u" [0-9a-fA-F]{4}) )* "\"" ws
number ::= ("-"? ([0-9] | [1-9] [0-9]{0,15})) ("." [0-9]+)? ([eE] [-+]? [0-9] [1-9]{0,15})? ws
ws ::= | " " | "\n" [ \t]{0,20}
'''
ARITHMETIC = r'''
root  ::= (expr "=" ws term "\n")+
expr  ::= term ([-+*/] term)*
term  ::= ident | num | "(" ws expr ")" ws
ident ::= [a-z] [a-z0-9_]* ws
num   ::= [0-9]+ ws
ws    ::= [ \t\n]*
'''
CLASSES = r'''root ::= [A-Z] [^aeiou\n]{2,5} [a-cx-z0-9_-]+ ("!" | "?")? .  # comment
'''
REPEAT = r'''root ::= ("ab" | "c"){2} "-" [0-9]{1,3} ("x"? "y")* "z"+ "end"'''
UNICODE = r'''root ::= [ぁ-ゟ]{1,4} ("。" | "\u3001") [^\x00-\x7F]+ "\U0001F600"? "!"'''
TOKENS = r'''root ::= "Answer: " [0-9]+ <|im_end|> | !<[42]> "x"'''
TOOL = r'''root ::= "<tool_call>" "{" "\"name\": \"" [a-z_]+ "\"}" "</tool_call>"'''

CASES = [  # (name, grammar, text to follow first, steps after it)
    ("json", JSON, '{"name": "Ana", "tags": ["a", 1.5e3], "ok": true}', 6),
    ("json-random", JSON, "", 24),
    ("arithmetic", ARITHMETIC, "x1 = (2 + y)*3\n", 8),
    ("classes", CLASSES, "Bxyz", 6),
    ("repeat", REPEAT, "abc-12x", 8),
    ("unicode", UNICODE, "ひらがな。日本", 6),
    ("tokens", TOKENS, "Answer: 4", 3),
]
LAZY_CASES = [  # (name, grammar, patterns, trigger token texts, text, steps)
    ("lazy-pattern", TOOL, [r"[\s\S]*?(<tool_call>)[\s\S]*"], [], "I will call it. <tool_call>{\"na", 6),
    ("lazy-full", TOOL, [r"^(<tool_call>)[\s\S]*$"], [], "<tool_call>", 4),
    ("lazy-token", r'root ::= "<|im_start|>" [a-z]+ "\n"', [], ["<|im_start|>"], "Well<|im_start|>", 3),
]
BAD = ["root ::= foo", "root ::= \"a", "root ::= [a", "root := \"a\"", "root ::= a\na ::= a \"x\"",
       "root ::= \"a\"{3000}", "root ::= \"\\q\"", "start ::= \"a\"", "root ::= (\"a\"", "root ::= <[12>"]


def _oracle_main(lib, vocab, request) -> list:
    import numpy as np
    vp = ctypes.c_void_p
    lib.llama_vocab_n_tokens.argtypes = [vp]
    lib.llama_vocab_is_eog.argtypes = [vp, ctypes.c_int32]
    lib.llama_vocab_is_eog.restype = ctypes.c_bool
    lib.llama_sampler_init_grammar.argtypes = [vp, ctypes.c_char_p, ctypes.c_char_p]
    lib.llama_sampler_init_grammar.restype = vp
    lib.llama_sampler_init_grammar_lazy_patterns.argtypes = [
        vp, ctypes.c_char_p, ctypes.c_char_p, ctypes.POINTER(ctypes.c_char_p), ctypes.c_size_t,
        ctypes.POINTER(ctypes.c_int32), ctypes.c_size_t]
    lib.llama_sampler_init_grammar_lazy_patterns.restype = vp

    class TokenData(ctypes.Structure):
        _fields_ = [("id", ctypes.c_int32), ("logit", ctypes.c_float), ("p", ctypes.c_float)]

    class TokenDataArray(ctypes.Structure):
        _fields_ = [("data", ctypes.POINTER(TokenData)), ("size", ctypes.c_size_t),
                    ("selected", ctypes.c_int64), ("sorted", ctypes.c_bool)]

    lib.llama_sampler_apply.argtypes = [vp, ctypes.POINTER(TokenDataArray)]
    lib.llama_sampler_accept.argtypes = [vp, ctypes.c_int32]
    lib.llama_sampler_free.argtypes = [vp]
    n = lib.llama_vocab_n_tokens(vocab)
    dtype = np.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")])
    results = []
    for case in request:
        if case.get("lazy"):
            pats = [p.encode() for p in case["patterns"]]
            arr = (ctypes.c_char_p * max(1, len(pats)))(*pats)
            toks = (ctypes.c_int32 * max(1, len(case["trigger_tokens"])))(*case["trigger_tokens"])
            smpl = lib.llama_sampler_init_grammar_lazy_patterns(vocab, case["grammar"].encode(), b"root", arr,
                                                                len(pats), toks, len(case["trigger_tokens"]))
        else:
            smpl = lib.llama_sampler_init_grammar(vocab, case["grammar"].encode(), b"root")
        if not smpl:
            results.append(None)
            continue
        rng = np.random.default_rng(case["seed"])
        forced, masks, path = list(case["forced"]), [], []
        for _ in range(len(forced) + case["steps"]):
            data = np.zeros(n, dtype=dtype)
            data["id"] = np.arange(n)
            data["logit"] = rng.standard_normal(n).astype(np.float32)
            logits = data["logit"].copy()
            cur = TokenDataArray(data.ctypes.data_as(ctypes.POINTER(TokenData)), n, -1, False)
            lib.llama_sampler_apply(smpl, ctypes.byref(cur))
            finite = np.isfinite(data["logit"])
            masks.append(np.packbits(finite).tobytes().hex())
            if forced:
                token = forced.pop(0)
            elif finite.any():
                token = int(np.argmax(np.where(finite, logits, -np.inf)))
            else:
                break
            path.append(token)
            if not finite[token]:
                break  # a forced token the grammar refuses: accepting it would abort
            lib.llama_sampler_accept(smpl, token)
            if lib.llama_vocab_is_eog(vocab, token):
                break
        lib.llama_sampler_free(smpl)
        results.append({"masks": masks, "path": path})
    return results


def run_oracle(bin_dir: Path, model: Path, request: list[dict], stderr: list | None = None) -> list:
    return libllama_child.run(_oracle_main, bin_dir, model, request, ORACLE_TIMEOUT, stderr)


@pytest.fixture(scope="module")
def vocab(model_path) -> Vocab:
    return Vocab.from_gguf(gguf.GGUFReader(model_path))


def _request(vocab: Vocab) -> tuple[list[dict], list[GrammarSampler]]:
    request, ours = [], []
    for i, (_, grammar, text, steps) in enumerate(CASES):
        forced = vocab.tokenize(text, add_special=False, parse_special=True)
        request.append({"grammar": grammar, "forced": forced, "steps": steps, "seed": 1000 + i})
        ours.append(GrammarSampler(grammar, vocab))
    for i, (_, grammar, patterns, words, text, steps) in enumerate(LAZY_CASES):
        triggers = [vocab.tokenize(w, add_special=False, parse_special=True)[0] for w in words]
        forced = vocab.tokenize(text, add_special=False, parse_special=True)
        request.append({"grammar": grammar, "lazy": True, "patterns": patterns, "trigger_tokens": triggers,
                        "forced": forced, "steps": steps, "seed": 2000 + i})
        ours.append(GrammarSampler(grammar, vocab, lazy=True, trigger_patterns=patterns, trigger_tokens=triggers))
    return request, ours


def test_allowed_tokens_match_libllama_along_each_path(bin_dir, model_path, vocab):
    request, ours = _request(vocab)
    results = run_oracle(bin_dir, model_path, request)
    names = [c[0] for c in CASES] + [c[0] for c in LAZY_CASES]
    probe = np.random.default_rng(7).choice(vocab.n_tokens, 400, replace=False)
    for name, sampler, result in zip(names, ours, results):
        assert result is not None, f"{name}: libllama refused the grammar"
        assert len(result["path"]) > 3, f"{name}: the path is too short to test anything"
        for step, (hexmask, token) in enumerate(zip(result["masks"], result["path"] + [None])):
            want = np.unpackbits(np.frombuffer(bytes.fromhex(hexmask), dtype=np.uint8))[:vocab.n_tokens].astype(bool)
            got = sampler.allowed_mask()
            diff = np.flatnonzero(got != want)
            assert not len(diff), (f"{name} step {step}: {len(diff)} tokens differ, e.g. "
                                   f"{[(int(t), vocab.token_to_piece(int(t), True), bool(want[t])) for t in diff[:5]]}")
            for t in np.concatenate([probe, np.flatnonzero(want)[:200]]):
                assert sampler.allows(int(t)) == want[t], f"{name} step {step}: allows({t}) disagrees"
            if token is None or not want[token]:
                break
            sampler.accept(token)


def test_bad_grammars_are_refused_by_both(bin_dir, model_path, vocab):
    """Refused by both, and a syntax error with libllama's message (it prints them to stderr; left
    recursion and a missing root go to its log instead)."""
    stderr: list[str] = []
    results = run_oracle(bin_dir, model_path, [{"grammar": g, "forced": [], "steps": 0, "seed": 0} for g in BAD], stderr)
    printed = iter(re.findall(r"error parsing grammar: (.*)", stderr[0]))
    for grammar, result in zip(BAD, results):
        assert result is None, f"libllama took {grammar!r}"
        with pytest.raises(GrammarError) as caught:
            GrammarSampler(grammar, vocab)
        if "left recursion" not in str(caught.value) and "symbol" not in str(caught.value):
            assert str(caught.value).split("\n")[0] == next(printed), grammar


# --- the chain: common_sampler_sample's draw, check and masked redraw -------------------------------------------

CHAIN_CASES = [  # (grammar, lazy patterns, temp, top_k, seed, text pushed by a logit bonus first)
    (JSON, None, 0.8, 40, 3, '{"a'),
    (JSON, None, 1.5, 0, 5, ""),
    (ARITHMETIC, None, 0.0, 40, 9, "x"),
    (TOOL, [r"[\s\S]*?(<tool_call>)[\s\S]*"], 1.0, 40, 4, "Sure. <tool_call>"),
]


def _chain_oracle_main(lib, vocab, request) -> list:
    import numpy as np
    vp, F, I32, SIZE = ctypes.c_void_p, ctypes.c_float, ctypes.c_int32, ctypes.c_size_t

    class TokenData(ctypes.Structure):
        _fields_ = [("id", ctypes.c_int32), ("logit", ctypes.c_float), ("p", ctypes.c_float)]

    class TokenDataArray(ctypes.Structure):
        _fields_ = [("data", ctypes.POINTER(TokenData)), ("size", ctypes.c_size_t),
                    ("selected", ctypes.c_int64), ("sorted", ctypes.c_bool)]

    class ChainParams(ctypes.Structure):
        _fields_ = [("no_perf", ctypes.c_bool)]

    for name, restype, argtypes in [
            ("llama_vocab_n_tokens", I32, [vp]),
            ("llama_sampler_init_grammar", vp, [vp, ctypes.c_char_p, ctypes.c_char_p]),
            ("llama_sampler_init_grammar_lazy_patterns", vp, [vp, ctypes.c_char_p, ctypes.c_char_p,
                                                             ctypes.POINTER(ctypes.c_char_p), SIZE, ctypes.c_void_p, SIZE]),
            ("llama_sampler_chain_default_params", ChainParams, []), ("llama_sampler_chain_init", vp, [ChainParams]),
            ("llama_sampler_chain_add", None, [vp, vp]), ("llama_sampler_init_penalties", vp, [I32, I32, F, F, F]),
            ("llama_sampler_init_top_k", vp, [I32]), ("llama_sampler_init_top_p", vp, [F, SIZE]),
            ("llama_sampler_init_min_p", vp, [F, SIZE]), ("llama_sampler_init_temp_ext", vp, [F, F, F]),
            ("llama_sampler_init_dist", vp, [ctypes.c_uint32]),
            ("llama_sampler_apply", None, [vp, ctypes.POINTER(TokenDataArray)]),
            ("llama_sampler_accept", None, [vp, I32]), ("llama_sampler_free", None, [vp])]:
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    n = lib.llama_vocab_n_tokens(vocab)
    dtype = np.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")])
    out = []
    for case in request:
        if case["patterns"] is not None:
            pats = [p.encode() for p in case["patterns"]]
            grmr = lib.llama_sampler_init_grammar_lazy_patterns(vocab, case["grammar"].encode(), b"root",
                                                                (ctypes.c_char_p * len(pats))(*pats), len(pats), None, 0)
        else:
            grmr = lib.llama_sampler_init_grammar(vocab, case["grammar"].encode(), b"root")
        chain = lib.llama_sampler_chain_init(lib.llama_sampler_chain_default_params())
        for smpl in (lib.llama_sampler_init_penalties(n, 64, 1.0, 0.0, 0.0), lib.llama_sampler_init_top_k(case["top_k"]),
                     lib.llama_sampler_init_top_p(0.95, 0), lib.llama_sampler_init_min_p(0.05, 0),
                     lib.llama_sampler_init_temp_ext(case["temp"], 0.0, 1.0), lib.llama_sampler_init_dist(case["seed"])):
            lib.llama_sampler_chain_add(chain, smpl)
        rng = np.random.default_rng(case["seed"])
        tokens = []
        for step in range(case["steps"]):
            logits = (3 * rng.standard_normal(n)).astype(np.float32)
            if step < len(case["pushed"]):
                logits[case["pushed"][step]] += 40

            def fresh():
                data = np.zeros(n, dtype=dtype)
                data["id"], data["logit"] = np.arange(n), logits
                return data, TokenDataArray(data.ctypes.data_as(ctypes.POINTER(TokenData)), n, -1, False)

            data, cur = fresh()
            lib.llama_sampler_apply(chain, ctypes.byref(cur))
            token = int(data["id"][cur.selected])
            one = np.array([(token, 1.0, 0.0)], dtype=dtype)
            single = TokenDataArray(one.ctypes.data_as(ctypes.POINTER(TokenData)), 1, -1, False)
            lib.llama_sampler_apply(grmr, ctypes.byref(single))
            if not np.isfinite(one["logit"][0]):
                data, cur = fresh()
                lib.llama_sampler_apply(grmr, ctypes.byref(cur))
                if not np.isfinite(data["logit"]).any():
                    break
                lib.llama_sampler_apply(chain, ctypes.byref(cur))
                token = int(data["id"][cur.selected])
            tokens.append(token)
            lib.llama_sampler_accept(grmr, token)
            lib.llama_sampler_accept(chain, token)
        out.append(tokens)
        lib.llama_sampler_free(grmr)
        lib.llama_sampler_free(chain)
    return out


def test_chain_draws_as_common_sampler_with_libllama(bin_dir, model_path, vocab):
    """Seeded draws through top-k/top-p/min-p/temperature with a grammar (and a lazy one) pick the same
    tokens as libllama's chain run the way common_sampler_sample runs it."""
    from orchestrator.sampling import Sampler, SamplingParams

    request = [{"grammar": g, "patterns": pats, "temp": temp, "top_k": k, "seed": seed, "steps": 40,
                "pushed": vocab.tokenize(text, add_special=False, parse_special=True)}
               for g, pats, temp, k, seed, text in CHAIN_CASES]
    for case, expected in zip(request, libllama_child.run(_chain_oracle_main, bin_dir, model_path, request,
                                                          ORACLE_TIMEOUT)):
        assert len(expected) > 10, f"libllama stopped early: {case['grammar'][:40]!r}"
        params = SamplingParams(temp=case["temp"], top_k=case["top_k"], seed=case["seed"], grammar=case["grammar"],
                                grammar_lazy=case["patterns"] is not None,
                                grammar_triggers=[("pattern", p) for p in case["patterns"] or []])
        sampler = Sampler(params, vocab.n_tokens, vocab)
        rng = np.random.default_rng(case["seed"])
        got = []
        for step in range(len(expected)):
            logits = (3 * rng.standard_normal(vocab.n_tokens)).astype(np.float32)
            if step < len(case["pushed"]):
                logits[case["pushed"][step]] += 40
            token = sampler.sample(logits)
            got.append(token)
            sampler.accept(token)
        assert got == expected, (case["grammar"][:40], vocab.token_to_piece(got[0]) if got else None)
