module github.com/kvhandoff/kvhandoff

go 1.26
