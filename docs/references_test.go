// Package docs holds kvhandoff's documentation; its test keeps the
// documentation's cross-references true.
package docs

import (
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"unicode"
)

// A citation names a Markdown file, optionally an anchor (#...) and a section
// (§N, §N.M) after it: "docs/design.md §3", "[spec.md](spec.md#coverage)",
// "[design.md](design.md) §3".
var (
	mdLink     = regexp.MustCompile(`\]\(([^)\s]+?\.md)(#[^)\s]*)?\)(\s+§(\d+(?:\.\d+)?))?`)
	mdBare     = regexp.MustCompile(`(^|[\s("'\x60])((?:\.\./|[\w-]+/)*[\w.-]+\.md)(#[\w-]+)?(\s+§(\d+(?:\.\d+)?))?`)
	headingRE  = regexp.MustCompile(`(?m)^(#{1,6})\s+(.+?)\s*$`)
	sectionRE  = regexp.MustCompile(`^(\d+(?:\.\d+)?)\.?\s`)
	outsideRef = regexp.MustCompile(`\.\./shared\b`)
)

// citation is one reference found in a file, resolved to the file it names.
type citation struct {
	from, target, anchor, section string
	line                          int
}

// TestEveryCitationResolves fails on a citation of a Markdown file, a heading
// anchor or a numbered section that does not exist, and on any reference to a
// file outside the repository: comments and docs cite docs/, nothing else.
func TestEveryCitationResolves(t *testing.T) {
	root := repoRoot(t)
	cites, outside := scan(t, root)
	if len(cites) < 50 {
		t.Fatalf("found only %d citations: the scanner is broken", len(cites))
	}
	for _, o := range outside {
		t.Error(o)
	}
	for _, c := range cites {
		if msg := resolve(root, c); msg != "" {
			t.Errorf("%s:%d: %s", c.from, c.line, msg)
		}
	}
}

// TestDanglingCitationsAreFound proves the check can fail: each citation
// below names something missing, and each must be reported.
func TestDanglingCitationsAreFound(t *testing.T) {
	root := repoRoot(t)
	for _, c := range []citation{
		{from: "spec/doc.go", target: "design.md", line: 1},                        // no spec/design.md
		{from: "spec/doc.go", target: "docs/design.md", section: "42", line: 1},    // no section 42
		{from: "docs/spec.md", target: "protocol.md", anchor: "#nowhere", line: 1}, // no such heading
		{from: "README.md", target: "docs/nothing.md", line: 1},
	} {
		if resolve(root, c) == "" {
			t.Errorf("the dangling citation %+v was accepted", c)
		}
	}
	for _, c := range []citation{
		{from: "spec/doc.go", target: "docs/design.md", section: "3", line: 1},
		{from: "docs/spec.md", target: "protocol.md", anchor: "#wire-format-implemented-protocol", line: 1},
		{from: "docs/protocol.md", target: "design.md", section: "5", line: 1},
	} {
		if msg := resolve(root, c); msg != "" {
			t.Errorf("the good citation %+v was refused: %s", c, msg)
		}
	}
}

func repoRoot(t *testing.T) string {
	t.Helper()
	dir, err := os.Getwd()
	if err != nil {
		t.Fatal(err)
	}
	for {
		if _, err := os.Stat(filepath.Join(dir, "go.mod")); err == nil {
			return dir
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			t.Fatal("no go.mod above the test's directory")
		}
		dir = parent
	}
}

// scan reads every .go and .md file of the repository and returns their
// citations, and the places that cite what cannot be resolved at all: a file
// outside the repository (../shared), or a section (§N) that names no file.
func scan(t *testing.T, root string) (cites []citation, outside []string) {
	t.Helper()
	err := filepath.WalkDir(root, func(path string, d os.DirEntry, err error) error {
		if err != nil {
			return err
		}
		name := d.Name()
		if d.IsDir() {
			if path != root && (strings.HasPrefix(name, ".") || name == "testdata") {
				return filepath.SkipDir
			}
			return nil
		}
		ext := filepath.Ext(name)
		if ext != ".go" && ext != ".md" {
			return nil
		}
		rel, _ := filepath.Rel(root, path)
		if rel == filepath.Join("docs", "references_test.go") {
			return nil // its own examples of dangling citations
		}
		b, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		for i, line := range strings.Split(string(b), "\n") {
			if outsideRef.MatchString(line) {
				outside = append(outside, rel+":"+strconv.Itoa(i+1)+" cites a file outside the repository")
			}
			sections := 0
			linked := map[int]bool{}
			if ext == ".md" {
				for _, m := range mdLink.FindAllStringSubmatchIndex(line, -1) {
					c := citation{from: rel, line: i + 1, target: line[m[2]:m[3]]}
					if m[4] >= 0 {
						c.anchor = line[m[4]:m[5]]
					}
					if m[8] >= 0 {
						c.section = line[m[8]:m[9]]
						sections++
					}
					if !strings.Contains(c.target, "://") {
						cites = append(cites, c)
					}
					linked[m[2]] = true
				}
			}
			for _, m := range mdBare.FindAllStringSubmatchIndex(line, -1) {
				if linked[m[4]] || (m[4] > 0 && line[m[4]-1] == '(' && ext == ".md") {
					continue // the target of a Markdown link, read above
				}
				c := citation{from: rel, line: i + 1, target: line[m[4]:m[5]]}
				if m[6] >= 0 {
					c.anchor = line[m[6]:m[7]]
				}
				if m[10] >= 0 {
					c.section = line[m[10]:m[11]]
					sections++
				}
				cites = append(cites, c)
			}
			if n := strings.Count(line, "§"); n > sections {
				outside = append(outside, rel+":"+strconv.Itoa(i+1)+" cites a section (§) without naming its file")
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return cites, outside
}

// resolve returns "" if the citation names an existing file (relative to the
// citing file's folder, or to the repository's root), heading and section.
func resolve(root string, c citation) string {
	var file string
	for _, base := range []string{filepath.Dir(filepath.Join(root, c.from)), root} {
		p := filepath.Join(base, c.target)
		if _, err := os.Stat(p); err == nil {
			file = p
			break
		}
	}
	if file == "" {
		return "cites " + c.target + ", which does not exist"
	}
	if c.anchor == "" && c.section == "" {
		return ""
	}
	b, err := os.ReadFile(file)
	if err != nil {
		return err.Error()
	}
	var slugs, sections []string
	for _, h := range headingRE.FindAllStringSubmatch(string(b), -1) {
		slugs = append(slugs, slug(h[2]))
		if m := sectionRE.FindStringSubmatch(h[2]); m != nil {
			sections = append(sections, m[1])
		}
	}
	if c.anchor != "" && c.anchor != "#" && !slices.Contains(slugs, strings.TrimPrefix(c.anchor, "#")) {
		return "cites " + c.target + c.anchor + ": no such heading"
	}
	if c.section != "" && !slices.Contains(sections, c.section) {
		return "cites " + c.target + " §" + c.section + ": no such section"
	}
	return ""
}

// slug is GitHub's anchor for a heading: lower case, punctuation dropped,
// spaces to hyphens.
func slug(h string) string {
	var b strings.Builder
	for _, r := range strings.ToLower(h) {
		switch {
		case unicode.IsLetter(r) || unicode.IsDigit(r) || r == '-' || r == '_':
			b.WriteRune(r)
		case r == ' ':
			b.WriteByte('-')
		}
	}
	return b.String()
}
