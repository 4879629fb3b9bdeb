"""Exact regular expressions for the common string ``format``s.

``FORMAT_PATTERNS[F]`` is an anchored regex (``^...$``) whose full matches are valid instances
of ``format: F`` (the official JSON-Schema-Test-Suite's optional format tests are the reference:
tests/runtime/grammar/test_grammar_formats.py). Each is either *exact* (accepts precisely the
valid strings) or a *subset* (over-strict: some valid strings are refused, no invalid one is
accepted); the comment of each says which and why. ``normalize._formats`` rewrites ``format``
into ``pattern`` with them, so every backend enforces the same language.

Dialect: the common subset of xgrammar, outlines-core and llguidance regexes (and ECMA-262 /
Python ``re``): literal characters, ``[...]`` classes with ASCII ranges (never ``\\d``, which
is Unicode in Python), non-capturing groups, ``|`` only inside a group, ``?`` and ``{m,n}``;
``^`` / ``$`` only at the ends (llguidance searches patterns; the others full-match). An
optional group is written ``(?:...){0,1}``, never ``(?:...)?``: xgrammar 0.2.8 compiles
``(?:ab*)?`` as if every item in it were optional (it accepts "b"), while ``{0,1}`` is exact.
"""

from __future__ import annotations

_HEX = "[0-9a-fA-F]"
_ALNUM = "[A-Za-z0-9]"
_LDH = "[A-Za-z0-9-]"

# RFC 3339 full-date: date-fullyear "-" date-month "-" date-mday, with the days of each month
# (section 5.7: 28/29 by leap year for February). Exact. A leap year (proleptic Gregorian, as
# RFC 3339 appendix C) is divisible by 4 but not by 100, or by 400: the last two digits are a
# non-zero multiple of 4, or they are 00 and the first two are a multiple of 4.
_MULTIPLE_OF_4 = "(?:[02468][048]|[13579][26])"
_LEAP_YEAR = f"(?:[0-9]{{2}}(?:0[48]|[2468][048]|[13579][26])|{_MULTIPLE_OF_4}00)"
_DATE = (
    "(?:[0-9]{4}-(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])"
    "|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)"
    "|02-(?:0[1-9]|1[0-9]|2[0-8]))"
    f"|{_LEAP_YEAR}-02-29)"
)

# RFC 3339 full-time: partial-time time-offset. time-hour 00-23, time-minute 00-59,
# time-second 00-59 (60 below), time-secfrac "." 1*DIGIT, time-offset "Z" / ("+" / "-")
# time-hour ":" time-minute; "T" and "Z" case-insensitive (section 5.6 NOTE).
_HOUR = "(?:[01][0-9]|2[0-3])"
_MINUTE = "[0-5][0-9]"
_FRAC = "(?:[.][0-9]+){0,1}"
_OFFSET = f"(?:[Zz]|[+-]{_HOUR}:{_MINUTE})"
_NORMAL_TIME = f"(?:{_HOUR}:{_MINUTE}:{_MINUTE}{_FRAC}{_OFFSET})"
# Leap second (time-second 60, section 5.7): valid only where the time is 23:59:60 in UTC,
# i.e. local time minus offset is 23:59. That crosses hour and minute digits of both (a
# 1440-way product), so this is a SUBSET: offsets whose minutes are 00, 15, 30 or 45 (every
# offset in use), each with the one local time it allows.
_LEAP_OFFSET_MINUTES = (0, 15, 30, 45)


def _leap_seconds() -> str:
    by_local: dict[str, list[str]] = {}
    for oh in range(24):
        for om in _LEAP_OFFSET_MINUTES:
            offset = oh * 60 + om
            minus = 1439 - offset  # local - (-offset) = 23:59  ->  local = 23:59 - offset
            plus = (offset - 1) % 1440  # local - offset = 23:59 (mod 24 h)
            for sign, local in (("-", minus), ("[+]", plus)):
                key = f"{local // 60:02d}:{local % 60:02d}"
                by_local.setdefault(key, []).append(f"{sign}{oh:02d}:{om:02d}")
    by_local["23:59"].append("[Zz]")
    branches = [
        f"{local}:60{_FRAC}(?:{'|'.join(offsets)})" for local, offsets in sorted(by_local.items())
    ]
    return f"(?:{'|'.join(branches)})"


_TIME = f"(?:{_NORMAL_TIME}|{_leap_seconds()})"

# RFC 4122 section 3: 8-4-4-4-12 hexadecimal digits (case-insensitive on input); any version /
# variant, as the suite says. Exact.
_UUID = f"{_HEX}{{8}}-{_HEX}{{4}}-{_HEX}{{4}}-{_HEX}{{4}}-{_HEX}{{12}}"

# RFC 2673 section 3.2 / RFC 3986 dec-octet: dotted quad of 0-255 without leading zeros. Exact.
_OCTET = "(?:25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])"
_IPV4 = f"{_OCTET}(?:[.]{_OCTET}){{3}}"

# RFC 4291 section 2.2 (the ABNF of RFC 3986 section 3.2.2, IPv6address): eight h16 groups,
# one "::" standing for one or more zero groups, the last 32 bits optionally as an IPv4 dotted
# quad. No zone id, no prefix length, no brackets. Exact.
_H16 = f"{_HEX}{{1,4}}"
_LS32 = f"(?:{_H16}:{_H16}|{_IPV4})"


def _ipv6() -> str:
    def groups(n: int) -> str:  # n x (h16 ":")
        return f"(?:{_H16}:){{{n}}}" if n else ""

    def head(n: int) -> str:  # [ *n( h16 ":" ) h16 ]
        return "" if n < 0 else f"(?:(?:{_H16}:){{0,{n}}}{_H16}){{0,1}}"

    branches = [f"{groups(6)}{_LS32}", f"::{groups(5)}{_LS32}"]
    branches += [f"{head(k)}::{groups(4 - k)}{_LS32}" for k in range(0, 4)]
    branches += [f"{head(4)}::{_LS32}", f"{head(5)}::{_H16}", f"{head(6)}::"]
    return f"(?:{'|'.join(branches)})"


_IPV6 = _ipv6()


# RFC 1123 section 2.1 hostname: dot-separated labels of letters, digits and "-", 1 to 63
# characters, not starting or ending with "-", at most 253 characters (no trailing dot).
# SUBSET: (1) no label has "--" in positions 3 and 4, so IDNA A-labels ("xn--...", which the
# suite checks as Punycode, RFC 5891 section 4.2.3.1) are refused; (2) the 253-character bound
# crosses labels, so only two shapes whose longest string fits are allowed: up to 3 labels of
# up to 63 characters, or 4 to 8 labels of up to 30.
def _label(max_len: int) -> str:
    rest = f"{_LDH}{{0,{max_len - 5}}}{_ALNUM}"
    return f"(?:{_ALNUM}(?:{_LDH}{{0,2}}{_ALNUM}|{_LDH}(?:{_ALNUM}{_LDH}|-{_ALNUM}){rest}){{0,1}})"


_HOSTNAME = f"(?:{_label(63)}(?:[.]{_label(63)}){{0,2}}|{_label(30)}(?:[.]{_label(30)}){{3,7}})"

# RFC 3986 section 3 / appendix A, URI (absolute, fragment allowed): scheme ":" hier-part
# [ "?" query ] [ "#" fragment ], hier-part = "//" authority path-abempty / path-absolute /
# path-rootless / path-empty; authority = [ userinfo "@" ] host [ ":" port ], host = IP-literal
# (IPv6 or IPvFuture in brackets) / IPv4address / reg-name. URI-reference = URI / relative-ref,
# relative-ref = relative-part [ "?" query ] [ "#" fragment ], relative-part = "//" authority
# path-abempty / path-absolute / path-noscheme (a first segment without ":") / path-empty.
# Exact (ASCII only).
#
# RFC 3987 section 2.2, IRI / IRI-reference: the same grammar with ucschar (U+00A0-D7FF,
# U+F900-FDCF, U+FDF0-FFEF, and U+x0000-xFFFD of planes 1-14) added to the unreserved
# characters, and iprivate (U+E000-F8FF, planes 15-16) to the query only. A subset: the BMP
# characters only (an IRI with an astral character is refused; the backends' regex dialects do
# not share a way to write astral ranges).
_UNRESERVED = "A-Za-z0-9._~"  # and "-", which each class below ends with
_UCSCHAR = "\u00a0-\ud7ff\uf900-\ufdcf\ufdf0-\uffef"
_IPRIVATE = "\ue000-\uf8ff"
_SUB_DELIMS = "!$&'()*+,;="
_PCT = f"%{_HEX}{_HEX}"


def _uri_reference(unreserved: str, private: str) -> tuple[str, str]:
    """(absolute URI, URI-reference) patterns, unanchored, for the given unreserved set."""
    userinfo = f"(?:[{unreserved}{_SUB_DELIMS}:-]|{_PCT})*"
    ip_literal = f"\\[(?:{_IPV6}|[vV]{_HEX}+[.][{_UNRESERVED}{_SUB_DELIMS}:-]+)\\]"
    reg_name = f"(?:[{unreserved}{_SUB_DELIMS}-]|{_PCT})*"
    authority = f"(?:{userinfo}@){{0,1}}(?:{ip_literal}|{_IPV4}|{reg_name})(?::[0-9]*){{0,1}}"
    pchar = f"(?:[{unreserved}{_SUB_DELIMS}:@-]|{_PCT})"
    segment_nz = f"{pchar}+"
    segment_nz_nc = f"(?:[{unreserved}{_SUB_DELIMS}@-]|{_PCT})+"
    path_abempty = f"(?:/{pchar}*)*"
    path_absolute = f"/(?:{segment_nz}{path_abempty}){{0,1}}"
    hier_part = f"(?://{authority}{path_abempty}|{path_absolute}|{segment_nz}{path_abempty}){{0,1}}"
    relative_part = (
        f"(?://{authority}{path_abempty}|{path_absolute}|{segment_nz_nc}{path_abempty}){{0,1}}"
    )
    query = f"(?:{pchar}|[/?{private}])*"
    fragment = f"(?:{pchar}|[/?])*"
    tail = f"(?:[?]{query}){{0,1}}(?:#{fragment}){{0,1}}"
    absolute = f"[A-Za-z][A-Za-z0-9+.-]*:{hier_part}{tail}"
    return absolute, f"(?:{absolute}|{relative_part}{tail})"


_URI, _URI_REFERENCE = _uri_reference(_UNRESERVED, "")
_IRI, _IRI_REFERENCE = _uri_reference(_UNRESERVED + _UCSCHAR, _IPRIVATE)

FORMAT_PATTERNS: dict[str, str] = {
    "date": f"^{_DATE}$",
    "time": f"^{_TIME}$",
    # RFC 3339 date-time: full-date "T" full-time ("T" case-insensitive).
    "date-time": f"^{_DATE}[Tt]{_TIME}$",
    "uuid": f"^{_UUID}$",
    "ipv4": f"^{_IPV4}$",
    "ipv6": f"^{_IPV6}$",
    "hostname": f"^{_HOSTNAME}$",
    "uri": f"^{_URI}$",
    "uri-reference": f"^{_URI_REFERENCE}$",
    "iri": f"^{_IRI}$",
    "iri-reference": f"^{_IRI_REFERENCE}$",
}
