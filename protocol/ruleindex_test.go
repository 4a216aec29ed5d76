package protocol

import (
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
)

// funcNames is every function and method declared in the Go files of dir,
// as "Name" and "Type.Name"; tests selects _test.go files, or the others.
func funcNames(t *testing.T, dir string, tests bool) map[string]bool {
	t.Helper()
	files, err := filepath.Glob(filepath.Join(dir, "*.go"))
	if err != nil {
		t.Fatal(err)
	}
	names := map[string]bool{}
	fset := token.NewFileSet()
	for _, f := range files {
		if strings.HasSuffix(f, "_test.go") != tests {
			continue
		}
		file, err := parser.ParseFile(fset, f, nil, parser.SkipObjectResolution)
		if err != nil {
			t.Fatal(err)
		}
		for _, d := range file.Decls {
			fn, ok := d.(*ast.FuncDecl)
			if !ok {
				continue
			}
			name := fn.Name.Name
			if fn.Recv != nil && len(fn.Recv.List) == 1 {
				typ := fn.Recv.List[0].Type
				if star, ok := typ.(*ast.StarExpr); ok {
					typ = star.X
				}
				if id, ok := typ.(*ast.Ident); ok {
					name = id.Name + "." + name
				}
			}
			names[name] = true
		}
	}
	return names
}

var backticked = regexp.MustCompile("`([^`]+)`")

// The rule index (docs/protocol.md, "Rule index", and this package's doc)
// names only functions and tests that exist, numbers its rules 1..N without
// a gap, and the package doc lists the same rules with the same tests.
func TestRuleIndexNamesRealFunctions(t *testing.T) {
	doc, err := os.ReadFile("../docs/protocol.md")
	if err != nil {
		t.Fatal(err)
	}
	specFuncs := funcNames(t, "../spec", false)
	impl := funcNames(t, ".", false)
	tests := funcNames(t, ".", true)
	_, section, ok := strings.Cut(string(doc), "## Rule index\n")
	if !ok {
		t.Fatal("docs/protocol.md has no Rule index")
	}
	section, _, _ = strings.Cut(section, "\n## ")
	docTests := map[int][]string{}
	rules := 0
	for _, line := range strings.Split(section, "\n") {
		cols := strings.Split(line, "|")
		if len(cols) != 7 {
			continue
		}
		n, err := strconv.Atoi(strings.TrimSpace(cols[1]))
		if err != nil {
			continue // the header
		}
		rules++
		if n != rules {
			t.Fatalf("rule %d follows rule %d", n, rules-1)
		}
		for _, m := range backticked.FindAllStringSubmatch(cols[3], -1) {
			if !specFuncs["sys."+m[1]] {
				t.Errorf("rule %d: spec function %s is not a method of spec's sys", n, m[1])
			}
		}
		for _, m := range backticked.FindAllStringSubmatch(cols[4], -1) {
			if !impl[m[1]] {
				t.Errorf("rule %d: implementation %s is not declared in protocol/", n, m[1])
			}
		}
		for _, m := range backticked.FindAllStringSubmatch(cols[5], -1) {
			if !tests[m[1]] {
				t.Errorf("rule %d: test %s is not declared in protocol/", n, m[1])
			}
			docTests[n] = append(docTests[n], m[1])
		}
		if len(docTests[n]) == 0 {
			t.Errorf("rule %d names no test", n)
		}
	}
	if rules < 18 {
		t.Fatalf("the index has %d rules", rules)
	}
	// The package doc's index: one line per rule, "N. what: implementation — tests".
	pkg, err := os.ReadFile("doc.go")
	if err != nil {
		t.Fatal(err)
	}
	line := regexp.MustCompile(`(?m)^//\s+(\d+)\. .*$`)
	seen := 0
	for _, m := range line.FindAllStringSubmatch(string(pkg), -1) {
		n, _ := strconv.Atoi(m[1])
		seen++
		if n != seen {
			t.Fatalf("doc.go: rule %d follows rule %d", n, seen-1)
		}
		for _, test := range docTests[n] {
			if !strings.Contains(m[0], test) {
				t.Errorf("doc.go: rule %d does not name %s, which docs/protocol.md does", n, test)
			}
		}
	}
	if seen != rules {
		t.Fatalf("doc.go lists %d rules, docs/protocol.md %d", seen, rules)
	}
}
