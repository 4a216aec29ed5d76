package node

import (
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// The official OpenAI Node client (npm "openai") against a running
// deployment: models.list, completions and chat completions with and
// without stream: true, n, stop, logprobs, and an unsupported parameter a
// 400 naming it (testdata/openai_client.cjs). It needs node and the openai module, in
// the node_modules directory KVH_OPENAI_MODULES names (.ci/run installs both
// and sets it); without node it skips, saying so, and with
// KVH_OPENAI_MODULES set it never skips.
func TestOfficialOpenAINodeClient(t *testing.T) {
	modules := os.Getenv("KVH_OPENAI_MODULES")
	nodeBin, err := exec.LookPath("node")
	if err != nil {
		if modules != "" {
			t.Fatal("KVH_OPENAI_MODULES is set but node is not on PATH")
		}
		t.Skip("node is not installed: the official OpenAI client cannot run here (CI installs nodejs and npm's openai)")
	}
	if modules == "" {
		t.Skip("KVH_OPENAI_MODULES does not name a node_modules holding npm's openai (npm install --prefix DIR openai@4; KVH_OPENAI_MODULES=DIR/node_modules), as .ci/run does")
	}
	if _, err := os.Stat(filepath.Join(modules, "openai")); err != nil {
		t.Fatalf("KVH_OPENAI_MODULES=%s holds no openai module: %v", modules, err)
	}
	l := localBuiltin(t, LocalConfig{PrefillPages: 128, DecodePages: 128})
	cmd := exec.Command(nodeBin, "testdata/openai_client.cjs", "http://"+l.API+"/v1")
	cmd.Env = append(os.Environ(), "NODE_PATH="+modules)
	var stderr strings.Builder
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("the OpenAI client: %v\n%s", err, stderr.String())
	}
	var seen map[string]string
	if err := json.Unmarshal(out, &seen); err != nil {
		t.Fatalf("the client printed %q: %v", out, err)
	}
	t.Logf("the OpenAI client saw %v", seen)
	if seen["model"] != l.Router.modelID("") || !strings.HasPrefix(seen["completion"], "QX7-zeta") || seen["stopped"] != "QX7" || seen["refused"] != "suffix unsupported_parameter" {
		t.Fatalf("the OpenAI client saw %v", seen)
	}
	allPagesBack(t, l)
}
