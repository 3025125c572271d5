"""Reading a GBNF grammar's text as llama.cpp does, for the checks and rewrites made before it
parses one (limits on a client's grammar, the JSON grammars' trailing space, the tool grammars'
renames): where string literals, character classes and comments are."""

from __future__ import annotations

import re

# String literals and character classes (with their escapes).
GBNF_LITERALS = re.compile(r'"(?:\\.|[^"\\])*"|\[(?:\\.|[^\]\\])*\]')
# A comment runs to the end of its line, "\r" or "\n" (llama.cpp's parse_space).
GBNF_COMMENT = r"#[^\r\n]*"
# What is not structure: literals, classes and comments (a quote or bracket in a comment
# read as one opening swallowed the structure after it).
GBNF_TEXT = re.compile(f"{GBNF_LITERALS.pattern}|{GBNF_COMMENT}")
