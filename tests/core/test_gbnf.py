"""Reading GBNF for a rule that begins with itself (pure: no llama.cpp)."""

from __future__ import annotations

import pytest

from justllm.core.gbnf import left_recursion


@pytest.mark.parametrize("gbnf, rule", [
    ('root ::= root "a" | "b"', "root"),
    ('root ::= x? root "a"\nx ::= "b"', "root"),  # behind what may match nothing
    ('root ::= ("" | "a") root', "root"),
    ('root ::= [a]{0,3} root', "root"),
    ('root ::= a\na ::= b\nb ::= (c | "x")\nc ::= a "y"', "a"),  # through other rules
    ('root ::= e root\ne ::= "a"*', "root"),  # a rule that may match nothing
    ('root ::= ( # "\n root )', "root"),  # a quote in a comment is no literal
])
def test_a_rule_that_may_begin_with_itself_is_found(gbnf, rule):
    assert left_recursion(gbnf) == rule


@pytest.mark.parametrize("gbnf", [
    'root ::= "a" root | "b"',
    'root ::= [a]{1,3} root | "x"',
    'root ::= x root\nx ::= "b"+',
    'root ::= "[" (root ("," root)*)? "]"',
    'root ::= "#" root | "b"',  # a # in a literal is no comment
    'root ::= (((',  # not read here: llama.cpp says what is wrong
])
def test_grammars_without_it_pass(gbnf):
    assert left_recursion(gbnf) is None
