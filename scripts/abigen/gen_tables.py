"""Dev tool: read NVIDIA open-gpu-kernel-modules headers at a tag and print devbroker's own
layout table (DSL) for the structs it is asked about.  Not shipped in the package."""
import re, os, sys, json, glob

ROOT = sys.argv[1]  # /tmp/h/<tag>
DIRS = ["src/common/sdk/nvidia/inc", "kernel-open/common/inc", "kernel-open/nvidia-uvm",
        "src/nvidia/arch/nvalloc/unix/include"]
files = []
for d in DIRS:
    for p in glob.glob(os.path.join(ROOT, d, "**", "*.h"), recursive=True):
        files.append(p)

def strip(s):
    s = re.sub(r"/\*.*?\*/", " ", s, flags=re.S)
    s = re.sub(r"//[^\n]*", " ", s)
    s = re.sub(r"\\\n", " ", s)
    return s

defines = {}
text_by_file = {}
for p in files:
    raw = open(p, errors="replace").read()
    t = strip(raw)
    text_by_file[p] = (raw, t)
    for m in re.finditer(r"^[ \t]*#[ \t]*define[ \t]+(\w+)[ \t]+(.+)$", t, flags=re.M):
        defines.setdefault(m.group(1), m.group(2).strip())

def ev(expr, depth=0):
    e = expr.strip()
    if depth > 20: raise ValueError(expr)
    e = re.sub(r"\b(0x[0-9a-fA-F]+|\d+)[uUlL]+\b", r"\1", e)
    e = re.sub(r"\(\s*(NvU32|NvU64|NvS32|int|unsigned)\s*\)", "", e)
    def rep(m):
        n = m.group(0)
        if n in defines: return "(" + str(ev(defines[n], depth+1)) + ")"
        raise ValueError("undefined " + n)
    e2 = re.sub(r"\b[A-Za-z_]\w*\b", rep, e)
    e2 = e2.replace("/", "//")
    return int(eval(e2, {}))

# ---- collect typedefs
structs = {}  # name -> (kind, body, file)
aliases = {}
arr_alias = {}
tags = {}
BASIC = {"NvU8":"u8","NvV8":"u8","char":"u8","unsigned char":"u8","NvBool":"bool","NvS8":"i8",
  "NvU16":"u16","NvV16":"u16","NvS16":"i16","NvU32":"u32","NvV32":"u32","unsigned":"u32",
  "unsigned int":"u32","int":"i32","NvS32":"i32","NvU64":"u64","NvV64":"u64","NvS64":"i64",
  "NvHandle":"handle","NvP64":"ptr","NvF32":"f32","NvF64":"f64","NvUPtr":"u64","NvLength":"u64",
  "NV_STATUS":"status","int32_t":"i32","uint32_t":"u32","uint64_t":"u64","uint8_t":"u8","int64_t":"i64","uint16_t":"u16","NvUuid":None, "NvProcessorUuid":None, "NvOffset":"u64", "NvU64_ALIGN32":None}

def find_typedefs(t, p):
    i = 0
    for m in re.finditer(r"\btypedef\s+(struct|union|enum)\s*(\w*)\s*\{", t):
        start = m.end(); depth = 1; j = start
        while depth:
            c = t[j]
            if c == "{": depth += 1
            elif c == "}": depth -= 1
            j += 1
        body = t[start:j-1]
        rest = re.match(r"\s*([^;]*);", t[j:])
        names = [n.strip() for n in rest.group(1).split(",")]
        for n in names:
            n = n.strip().lstrip("*")
            if re.match(r"^\w+$", n):
                if m.group(1) == "enum": aliases[n] = "NvU32"
                else: structs.setdefault(n, (m.group(1), body, p))
        if m.group(2):
            if m.group(1) == "enum": aliases[m.group(2)] = "NvU32"
            else: tags.setdefault(m.group(2), (m.group(1), body, p))
    for m in re.finditer(r"\btypedef\s+(?:struct|union)\s+(\w+)\s+(\w+)\s*;", t):
        aliases.setdefault(m.group(2), "tag:" + m.group(1))
    for m in re.finditer(r"\btypedef[ \t]+(\w+)[ \t]+(\w+)[ \t]*\[([^\]]+)\][ \t]*;", t):
        arr_alias.setdefault(m.group(2), (m.group(1), m.group(3)))
    for m in re.finditer(r"\btypedef[ \t]+([\w \t]+?)[ \t]+(\w+)[ \t]*;", t):
        if m.group(1).startswith(("struct","union","enum")): continue
        aliases.setdefault(m.group(2), m.group(1).strip())
    for m in re.finditer(r"^[ \t]*#[ \t]*define[ \t]+(\w+)[ \t]+(\w+)[ \t]*$", t, flags=re.M):
        if m.group(2) in structs or m.group(2).endswith(("_PARAMS","_PARAMETERS")):
            aliases.setdefault(m.group(1), m.group(2))

for p,(raw,t) in text_by_file.items():
    find_typedefs(t, p)

out = {}      # name -> dsl
srcs = {}     # name -> file
layout = {}   # name -> (size, align)

def resolve_type(tn):
    tn = tn.strip()
    tn = re.sub(r"\b(const|volatile)\b", "", tn).strip()
    tn = re.sub(r"^struct\s+", "", tn)
    for _ in range(10):
        if tn in BASIC and BASIC[tn]: return ("basic", BASIC[tn])
        if tn in structs: return ("struct", tn)
        if tn in tags:
            structs[tn] = tags[tn]; return ("struct", tn)
        if tn in aliases:
            a = aliases[tn]
            if a.startswith("tag:"):
                tg = a[4:]
                if tg in tags:
                    structs.setdefault(tn, tags[tg]); return ("struct", tn)
                raise ValueError("unknown tag " + tg)
            tn = a; continue
        break
    raise ValueError("unknown type " + tn)

SZ = {"u8":1,"bool":1,"i8":1,"u16":2,"i16":2,"u32":4,"i32":4,"handle":4,"status":4,"f32":4,"u64":8,"i64":8,"ptr":8,"f64":8}

def split_members(body):
    # split on ; at depth 0
    res=[]; depth=0; cur=""
    for c in body:
        if c=="{": depth+=1
        elif c=="}": depth-=1
        if c==";" and depth==0:
            res.append(cur.strip()); cur=""
        else: cur+=c
    if cur.strip(): res.append(cur.strip())
    return res

def gen(name, kind=None, body=None, p=None):
    if name in out: return layout[name]
    if kind is None:
        kind, body, p = structs[name]
    items=[]; off=0; al=1; usize=0
    for mem in split_members(body):
        mem = mem.strip()
        if not mem or mem.startswith("#"): continue
        mem = re.sub(r"^\s*#.*$", "", mem, flags=re.M).strip()
        if not mem: continue
        m = re.match(r"NV_DECLARE_ALIGNED\s*\(\s*(.+?)\s+(\w+)\s*(\[[^\]]*\])*\s*,\s*(\d+)\s*\)$", mem, re.S)
        if m:
            mem = m.group(1) + " " + m.group(2) + (mem[m.end(2):m.start(4)].rstrip(", ") if False else "")
            # re-parse with arrays
            arr = re.findall(r"\[([^\]]*)\]", m.group(0).split(",")[0])
            tname, fname = m.group(1), m.group(2)
        else:
            mem = re.sub(r"(NV_ALIGN_BYTES|__aligned)\s*\(\s*\d+\s*\)", "", mem).strip()
            im = re.match(r"(struct|union)\s*(\w*)\s*\{(.*)\}\s*(\w+)\s*((?:\[[^\]]*\])*)$", mem, re.S)
            if im:
                sub = f"{name}__{im.group(4)}"
                sz, sal = gen(sub, im.group(1), im.group(3), p)
                tname, fname = sub, im.group(4)
                arr = re.findall(r"\[([^\]]*)\]", im.group(5))
            else:
                fm = re.match(r"(.+?)\s*(\**)\s*\b(\w+)\s*((?:\[[^\]]*\])*)\s*(?::\s*\d+)?$", mem, re.S)
                if not fm: raise ValueError(f"{name}: cannot parse member {mem!r}")
                tname, fname = fm.group(1), fm.group(3)
                if fm.group(2): tname = "NvP64"  # raw pointers (kernel-only structs)
                arr = re.findall(r"\[([^\]]*)\]", fm.group(4))
        if tname.strip() in arr_alias:
            bt, n = arr_alias[tname.strip()]
            arr = list(arr) + [n]; tname = bt
        count = 1
        for a in arr: count *= ev(a)
        k, t = resolve_type(tname) if tname not in out else ("struct", tname)
        if k == "struct":
            sz, sal = gen(t)
        else:
            sz = sal = SZ[t]
        # role by name
        if k == "basic":
            if t in ("u32",) and fname in ("status","Status","rmStatus"): t = "status"
            if t == "u32" and fname == "hClass": t = "class"
        if arr:
            if k == "basic" and t in ("u8",) : items.append(f"{fname}:bytes[{count}]")
            else: items.append(f"{fname}:{t}[{count}]")
        else:
            items.append(f"{fname}:{t}")
        if kind == "union":
            usize = max(usize, sz*count); al = max(al, sal)
        else:
            off += (-off) % sal; off += sz*count; al = max(al, sal)
    if kind == "union":
        size = usize + (-usize) % al
        layout[name] = (size, al); out[name] = f"union<{size},{al}>"; srcs[name]=p
        return layout[name]
    off += (-off) % al
    layout[name] = (off, al)
    out[name] = " ".join(items)
    srcs[name] = os.path.relpath(p, ROOT)
    return layout[name]

req = json.load(open(sys.argv[2]))
result = {"structs": {}, "sizes": {}, "sources": {}, "controls": {}, "classes": {}, "uvm": {}, "errors": []}
# controls: find cmd -> name, params
cmdmap = {}
for p,(raw,t) in text_by_file.items():
    for m in re.finditer(r"#define\s+(NV\w+_CTRL_\w+)\s+\((0x[0-9a-fA-F]+)U?\)\s*/\*\s*finn: Evaluated from \"(.*?)\"", raw):
        cmd = int(m.group(2), 16)
        mm = re.search(r"(\w+)_MESSAGE_ID", m.group(3))
        cmdmap.setdefault(cmd, (m.group(1), mm.group(1) if mm else None, os.path.relpath(p, ROOT)))
for p,(raw,t) in text_by_file.items():
    for m in re.finditer(r"#define[ \t]+(NV\w+_CTRL_\w+)[ \t]+\((0x[0-9a-fA-F]+)U?\)", raw):
        if "_GPS_" in m.group(1): continue
        cmdmap.setdefault(int(m.group(2),16), (m.group(1), None, os.path.relpath(p, ROOT)))
want_structs = list(req.get("structs", []))
for c in req["controls"]:
    cmd = int(c, 16)
    if cmd not in cmdmap:
        result["errors"].append(f"control {c} not found"); continue
    n, params, p = cmdmap[cmd]
    if not params and (n + "_PARAMS") in structs: params = n + "_PARAMS"
    if params and params not in structs and params not in aliases:
        # some controls reuse another's params; try CMD name
        alt = n.replace("_CMD_", "_") + "_PARAMS"
        params = alt if alt in structs else params
    result["controls"][c] = [n, params, p]
    if params: want_structs.append(params)
for c, (n, params) in req.get("classes", {}).items():
    result["classes"][c] = [n, params]
    if params: want_structs.append(params)
for cmd, n in req.get("uvm", {}).items():
    pn = n + "_PARAMS"
    if n not in defines: continue
    result["uvm"][cmd] = [n, pn if (pn in structs or pn in aliases) else None]
    if result["uvm"][cmd][1]: want_structs.append(pn)
for s in want_structs:
    try:
        k, t = resolve_type(s)
        gen(t)
        if t != s: result["structs"][s] = "=" + t
    except Exception as e:
        result["errors"].append(f"{s}: {e}")
for n in out:
    result["structs"][n] = out[n]
    result["sizes"][n] = layout[n][0]
    result["sources"][n] = srcs.get(n, "")
json.dump(result, sys.stdout, indent=0, sort_keys=True)
