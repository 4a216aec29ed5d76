package node

import (
	"encoding/json"
	"net/http"
	"strconv"
	"strings"
	"time"
)

// ChatTemplate turns a conversation into the prompt text a model
// continues as the assistant.
type ChatTemplate func(messages []ChatMessage) string

// ChatMessage is one message of a conversation.
type ChatMessage struct {
	Role    string `json:"role"`
	Content string `json:"content"`
}

// PlainChat is the built-in model's template: each message as "role: text"
// on its own line, then "assistant:" for the model to continue. The
// built-in model has no chat training; the template is what its copy head
// continues.
func PlainChat(messages []ChatMessage) string {
	var b strings.Builder
	for _, m := range messages {
		b.WriteString(m.Role + ": " + m.Content + "\n")
	}
	b.WriteString("assistant:")
	return b.String()
}

// Llama2Chat is Llama 2's chat layout for llama2.c checkpoints: a system
// message in <<SYS>> inside the first [INST], each user turn in
// [INST] ... [/INST], each assistant turn after it. (The BOS the router puts
// first opens it; the </s><s> between turns are text here.)
func Llama2Chat(messages []ChatMessage) string {
	var b strings.Builder
	system := ""
	open := false
	for _, m := range messages {
		switch m.Role {
		case "system", "developer":
			system += m.Content
		case "user":
			if open {
				b.WriteString(" [/INST] ")
			}
			b.WriteString("[INST] ")
			if system != "" {
				b.WriteString("<<SYS>>\n" + system + "\n<</SYS>>\n\n")
				system = ""
			}
			b.WriteString(m.Content)
			open = true
		case "assistant":
			b.WriteString(" [/INST] " + m.Content + " </s><s>")
			open = false
		}
	}
	if open {
		b.WriteString(" [/INST]")
	}
	return b.String()
}

var chatRoles = map[string]bool{"system": true, "developer": true, "user": true, "assistant": true}

// parseMessages takes messages whose content is a string or an array of
// text parts; anything else (images, tool calls) is refused, naming it.
func parseMessages(raw json.RawMessage) ([]ChatMessage, error) {
	var in []map[string]json.RawMessage
	if err := json.Unmarshal(raw, &in); err != nil || len(in) == 0 {
		return nil, badParam("messages", "invalid_value", "messages is a non-empty array of {role, content}")
	}
	out := make([]ChatMessage, len(in))
	for i, m := range in {
		f := fields(m)
		var role string
		var content json.RawMessage
		if err := f.take("role", &role); err != nil {
			return nil, err
		}
		if !chatRoles[role] {
			return nil, badParam("messages", "invalid_value", "messages[%d].role %.32q: system, developer, user or assistant", i, role)
		}
		content = f["content"]
		delete(f, "content")
		delete(f, "name")
		if err := f.rest(); err != nil {
			e := err.(*RequestError)
			e.Param = "messages[" + strconv.Itoa(i) + "]." + e.Param
			return nil, e
		}
		var text string
		if json.Unmarshal(content, &text) != nil {
			var parts []struct {
				Type string `json:"type"`
				Text string `json:"text"`
			}
			if err := json.Unmarshal(content, &parts); err != nil {
				return nil, badParam("messages", "invalid_value", "messages[%d].content is a string or an array of text parts", i)
			}
			for _, p := range parts {
				if p.Type != "text" {
					return nil, badParam("messages", "unsupported_parameter", "messages[%d].content: parts of type %.32q are not supported (text only)", i, p.Type)
				}
				text += p.Text
			}
		}
		out[i] = ChatMessage{Role: role, Content: text}
	}
	return out, nil
}

type chatMessageOut struct {
	Role    string `json:"role,omitempty"`
	Content string `json:"content"`
}

type chatChoice struct {
	Index        int             `json:"index"`
	Message      *chatMessageOut `json:"message,omitempty"`
	Delta        *chatMessageOut `json:"delta,omitempty"`
	Logprobs     any             `json:"logprobs"`
	FinishReason *string         `json:"finish_reason"`
}

type chatResponse struct {
	ID      string       `json:"id"`
	Object  string       `json:"object"`
	Created int64        `json:"created"`
	Model   string       `json:"model"`
	Choices []chatChoice `json:"choices"`
	Usage   *usage       `json:"usage,omitempty"`
}

// chatCompletions is POST /v1/chat/completions: the conversation through
// the deployment's chat template, then a completion of it.
func (rt *Router) chatCompletions(w http.ResponseWriter, r *http.Request) {
	var f fields
	if !rt.decodeBody(w, r, &f) {
		return
	}
	p, messages, err := rt.chatRequest(f)
	if err != nil {
		rt.answerFailure(w, r, err)
		return
	}
	tenant, err := rt.tenantOf(r)
	if err != nil {
		rt.answerFailure(w, r, err)
		return
	}
	prompts := []prompt{{text: rt.cfg.ChatTemplate(messages)}}
	if p.stream {
		rt.streamAnswer(w, r, prompts, p, tenant, true)
		return
	}
	choices, err := rt.run(r.Context(), r, prompts, p, tenant, nil)
	if err != nil {
		rt.failed(w, r, err, nil)
		return
	}
	id, created, modelName := "chatcmpl-"+choices[0].res.handoffHex(), time.Now().Unix(), rt.modelID(p.model)
	u := usageOf(choices, p.n)
	rt.counted(choices, u)
	out := chatResponse{ID: id, Object: "chat.completion", Created: created, Model: modelName, Usage: &u}
	for _, c := range choices {
		out.Choices = append(out.Choices, chatChoice{Index: c.index, Message: &chatMessageOut{Role: "assistant", Content: c.text}, Logprobs: c.chatLogprobs(), FinishReason: &c.finish})
	}
	servedBy(w, choices)
	writeJSON(w, http.StatusOK, out)
}

func (rt *Router) chatRequest(f fields) (genParams, []ChatMessage, error) {
	maxName := "max_tokens"
	if _, ok := f["max_completion_tokens"]; ok {
		if _, both := f["max_tokens"]; both {
			return genParams{}, nil, badParam("max_completion_tokens", "invalid_value", "max_tokens and max_completion_tokens exclude each other")
		}
		maxName = "max_completion_tokens"
	}
	p, err := rt.common(f, maxName)
	if err != nil {
		return p, nil, err
	}
	raw := f["messages"]
	delete(f, "messages")
	messages, err := parseMessages(raw)
	if err != nil {
		return p, nil, err
	}
	var logprobs bool
	var top *int
	for _, e := range []error{f.take("logprobs", &logprobs), f.take("top_logprobs", &top), f.only("tools", "[]"), f.only("tool_choice", `"none"`),
		f.only("response_format", `{"type":"text"}`), f.only("parallel_tool_calls"), f.rest()} {
		if e != nil {
			return p, nil, e
		}
	}
	switch {
	case top != nil && !logprobs:
		return p, nil, badParam("top_logprobs", "invalid_value", "top_logprobs needs logprobs: true")
	case top != nil && (*top < 0 || *top > maxTopLogprobs):
		return p, nil, badParam("top_logprobs", "invalid_value", "top_logprobs %d is outside 0..%d", *top, maxTopLogprobs)
	case logprobs:
		k := 0
		if top != nil {
			k = *top
		}
		p.logprobs = &k
	}
	return p, messages, nil
}
