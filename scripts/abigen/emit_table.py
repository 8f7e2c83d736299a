import json, sys, pprint
def load(t): return json.load(open(f'/tmp/abigen/out_{t}.json'))
def table(r):
    structs = {n: (d, r['sources'].get(n, '')) for n, d in r['structs'].items()}
    controls = {int(c,16): (v[0], v[1], v[2]) for c, v in r['controls'].items()}
    classes = {int(c,16): (v[0], v[1]) for c, v in r['classes'].items()}
    uvm = {int(c,16): (v[0], v[1]) for c, v in r['uvm'].items()}
    sizes = dict(r['sizes'])
    return structs, controls, classes, uvm, sizes
def fmt_dict(name, d, hexkeys=False):
    out=[f"{name} = {{"]
    for k in sorted(d, key=lambda x: (str(type(x)), x)):
        kk = f"0x{k:x}" if hexkeys else repr(k)
        out.append(f"    {kk}: {d[k]!r},")
    out.append("}")
    return "\n".join(out)
hdr = '''"""GENERATED layout table: do not edit by hand; regenerate (see docs/abi.md).

Read from NVIDIA open-gpu-kernel-modules tag {tag} headers by devbroker's header reader, written
in devbroker's own field DSL (see spec.parse_fields).  {extra}
"""
# fmt: off
TAG = {tag!r}
'''
base = table(load('580.142'))
s = hdr.format(tag='580.142', extra='Facts only: names, types, array lengths.')
s += fmt_dict("STRUCTS", base[0]) + "\n\n" + fmt_dict("CONTROLS", base[1], True) + "\n\n" + fmt_dict("CLASSES", base[2], True) + "\n\n" + fmt_dict("UVM", base[3], True) + "\n\n# sizeof() of every struct above as the reader computed it (checked again by tests)\n" + fmt_dict("SIZES", base[4]) + "\n"
open('/work/main/src/devbroker/abi/tables/hdr_580_142.py','w').write(s)
old = table(load('535.288.01'))
diff = []
for i, nm in enumerate(["STRUCTS","CONTROLS","CLASSES","UVM","SIZES"]):
    a, b = base[i], old[i]
    if nm in ("CONTROLS",):
        # compare without header path
        ch = {k: v for k, v in b.items() if k not in a or a[k][:2] != v[:2]}
    elif nm == "STRUCTS":
        ch = {k: v for k, v in b.items() if k not in a or a[k][0] != v[0]}
    else:
        ch = {k: v for k, v in b.items() if a.get(k) != v}
    gone = sorted(k for k in a if k not in b)
    diff.append(fmt_dict(nm + "_CHANGED", ch, nm not in ("STRUCTS","SIZES")))
    diff.append(f"{nm}_REMOVED = " + (pprint.pformat([f'0x{x:x}' if isinstance(x,int) else x for x in gone]) if nm not in ("STRUCTS","SIZES") else pprint.pformat(gone)).replace("'0x","0x").replace("',",",").replace("']","]") if nm not in ("STRUCTS","SIZES") else f"{nm}_REMOVED = " + pprint.pformat(gone))
s = hdr.format(tag='535.288.01', extra='Only what differs from the 580.142 table (hdr_580_142): changed or added entries, and entries the 535 headers do not have.')
s += "\n\n".join(diff) + "\n"
open('/work/main/src/devbroker/abi/tables/hdr_535_288_01.py','w').write(s)
