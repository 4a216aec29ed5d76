package spec

import (
	"encoding/binary"
	"errors"
	"reflect"
	"testing"
)

// plain reports whether t holds only numbers, booleans, arrays and structs of
// them: values whose bytes are the whole value, as the state encoding needs.
func plain(t reflect.Type) bool {
	switch t.Kind() {
	case reflect.Bool, reflect.Int8, reflect.Uint8, reflect.Int16, reflect.Uint16, reflect.Int32,
		reflect.Uint32, reflect.Int64, reflect.Uint64, reflect.Int, reflect.Uint:
		return true
	case reflect.Array:
		return plain(t.Elem())
	case reflect.Struct:
		for i := 0; i < t.NumField(); i++ {
			if !plain(t.Field(i).Type) {
				return false
			}
		}
		return true
	}
	return false
}

func TestStateIsPlainData(t *testing.T) {
	if !plain(reflect.TypeOf(State{})) {
		t.Fatal("State holds a pointer, slice, map, string or float: AppendState's byte encoding would be wrong")
	}
}

// reachable returns up to limit states reachable in cfg, breadth-first.
func reachable(t *testing.T, cfg Config, limit int) (*Model, []State) {
	t.Helper()
	m, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	seen := map[State]bool{}
	queue := m.Initial()
	var out []State
	for len(queue) > 0 && len(out) < limit {
		s := queue[0]
		queue = queue[1:]
		if seen[s] {
			continue
		}
		seen[s] = true
		out = append(out, s)
		m.Successors(&s, func(_ Action, n *State) { queue = append(queue, *n) })
	}
	return m, out
}

func TestEncodingRoundTripsReachableStates(t *testing.T) {
	for _, cfg := range []Config{NewConfig(3, 4, 2), func() Config { c := NewConfig(3, 6, 2); c.Prompts = []int{4, 4, 9}; c.PrefillPages = 4; return c }()} {
		m, states := reachable(t, cfg, 20000)
		total := 0
		var buf []byte
		for i := range states {
			buf = m.AppendState(buf[:0], &states[i])
			total += len(buf)
			var got State
			if err := m.DecodeState(buf, &got); err != nil {
				t.Fatalf("state %d: %v", i, err)
			}
			if got != states[i] {
				t.Fatalf("state %d does not round-trip:\n%+v\n%+v", i, states[i], got)
			}
		}
		t.Logf("%d states, %d bytes per encoding on average (a State is %d)", len(states), total/len(states), stateSize)
		if avg := total / len(states); avg > stateSize/4 {
			t.Errorf("%d bytes per encoded state on average, want well under the %d of a State", avg, stateSize)
		}
	}
}

func TestDecodeRefusesMalformedEncodings(t *testing.T) {
	m, _ := New(NewConfig(3, 4, 2))
	var s State
	for _, b := range [][]byte{
		{0x80},       // a truncated uvarint
		{0, 5, 1, 2}, // fewer literal bytes than announced
		append(binary.AppendUvarint(nil, uint64(stateSize)), 1, 0xaa), // a run past the end of the state
	} {
		if err := m.DecodeState(b, &s); !errors.Is(err, ErrBadEncoding) {
			t.Errorf("%x: got %v, want ErrBadEncoding", b, err)
		}
	}
}
